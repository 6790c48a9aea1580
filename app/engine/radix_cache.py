"""Page-aligned prefix cache over token ids: a radix tree whose edges are whole pages.

Pure bookkeeping over ints -- no torch -- so it is tested on the CPU with tiny pages.

Every node below the root stands for one KV page holding `page_size` consecutive tokens,
and its key is exactly those tokens; a path from the root spells a cached token prefix whose
KV is resident. Only full pages are cached, so a match is always page-aligned.

Ownership invariant: a page belongs to exactly one of
  - the free list (`PagePool`),
  - the tree (cached: a node holds it),
  - one running request (in use: reserved for positions the tree does not hold).
`check_integrity(pool, in_use)` asserts `free + cached + in_use == all pages`.

Locking: a request that adopts a prefix locks its nodes (each node on the path counts its
lockers); a locked node is never evicted. Eviction takes the least recently used unlocked
leaf, repeatedly, so a prefix outlives the longer conversations built on it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

_clock = itertools.count()  # a logical clock: strictly increasing, never equal


@dataclass(eq=False)
class Node:
    page: int
    key: tuple[int, ...]
    parent: "Node | None"
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    lock_count: int = 0
    last_used: int = 0

    def touch(self) -> None:
        self.last_used = next(_clock)


class PagePool:
    """Free pages of the KV pool. Page 0 is reserved (a zeroed padding target), never handed out."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least two pages")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages with {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)


class RadixCache:
    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.root = Node(page=-1, key=(), parent=None)
        self._cached = 0

    @property
    def cached_pages(self) -> int:
        return self._cached

    def _pages_of(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i:i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def match(self, tokens: Sequence[int]) -> list[Node]:
        """Nodes of the longest cached page-aligned prefix of `tokens`, root excluded."""
        path, node = [], self.root
        for key in self._pages_of(tokens):
            node = node.children.get(key)
            if node is None:
                break
            node.touch()
            path.append(node)
        return path

    def lock(self, path: Sequence[Node]) -> None:
        for node in path:
            node.lock_count += 1

    def unlock(self, path: Sequence[Node]) -> None:
        for node in path:
            if node.lock_count <= 0:
                raise AssertionError("unlocking a node that is not locked")
            node.lock_count -= 1

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Publish a sequence's full pages. `pages[i]` holds tokens [i*ps, (i+1)*ps).

        Pages the tree takes become cached. Returns the caller's pages the tree did not take
        (their tokens were cached already, e.g. by another request): the caller frees them,
        except any that are the tree's own node pages (an adopted prefix), which are not
        returned.
        """
        keys = self._pages_of(tokens)
        if len(pages) < len(keys):
            raise ValueError("every full page of tokens needs its KV page")
        redundant, node = [], self.root
        for key, page in zip(keys, pages):
            child = node.children.get(key)
            if child is None:
                child = Node(page=page, key=key, parent=node)
                node.children[key] = child
                self._cached += 1
            elif child.page != page:
                redundant.append(page)
            child.touch()
            node = child
        return redundant

    def evict(self, n_pages: int) -> list[int]:
        """Remove up to `n_pages` least recently used unlocked leaves; return their pages."""
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in self._leaves() if not leaf.lock_count]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key]
            self._cached -= 1
            freed.append(leaf.page)
            if parent is not self.root and not parent.children and not parent.lock_count:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def evictable_pages(self) -> int:
        """Pages eviction could free now. Locks cover whole paths from the root, so an
        unlocked node has no locked descendant and will go once its subtree has gone."""
        return sum(1 for node in self._nodes() if not node.lock_count)

    def clear(self) -> list[int]:
        """Drop every unlocked page (e.g. "clear cache" for a cold benchmark)."""
        return self.evict(self._cached)

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                yield node

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_pages(self) -> list[int]:
        return [node.page for node in self._nodes()]

    def check_integrity(self, pool: PagePool, in_use: Sequence[int] = ()) -> None:
        """Assert the ownership invariant: every usable page is free, cached or in use, once."""
        cached = self.all_pages()
        assert len(cached) == self._cached, "cached page count drifted"
        owners = list(pool._free) + cached + list(in_use)
        assert len(owners) == len(set(owners)), "a page has two owners"
        assert sorted(owners) == list(range(1, pool.num_pages)), (
            f"free {pool.free_count} + cached {len(cached)} + in use {len(in_use)} "
            f"!= {pool.usable} pages")
