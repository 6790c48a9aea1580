"""Prefix-cache bookkeeping over ints, with 4-token pages."""

from __future__ import annotations

import pytest

from app.engine.radix_cache import PagePool, RadixCache


def setup(num_pages=20):
    return PagePool(num_pages), RadixCache(page_size=4)


def test_page_zero_is_never_handed_out():
    pool = PagePool(5)
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_insert_then_match_whole_pages_only():
    pool, cache = setup()
    pages = pool.allocate(3)
    tokens = list(range(10))  # two full pages and a partial one
    assert cache.insert(tokens, pages[:2]) == []
    pool.release(pages[2:])
    assert [n.page for n in cache.match(tokens)] == pages[:2]
    assert [n.page for n in cache.match(tokens[:7])] == pages[:1]
    assert cache.match([99] + tokens[1:]) == []
    cache.check_integrity(pool)


def test_shared_prefix_branches_and_redundant_pages_come_back():
    pool, cache = setup()
    a, b = pool.allocate(2), pool.allocate(2)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], a)
    # Same first page, different second: the first of b is redundant, the second is new.
    assert cache.insert([1, 2, 3, 4, 9, 9, 9, 9], b) == [b[0]]
    pool.release([b[0]])
    assert cache.cached_pages == 3
    cache.check_integrity(pool)


def test_reinserting_adopted_pages_returns_nothing():
    pool, cache = setup()
    a = pool.allocate(2)
    cache.insert(list(range(8)), a)
    path = cache.match(list(range(12)))
    own = pool.allocate(1)
    assert cache.insert(list(range(12)), [n.page for n in path] + own) == []
    assert cache.cached_pages == 3
    cache.check_integrity(pool)


def test_locked_nodes_are_not_evicted_and_lru_goes_first():
    pool, cache = setup()
    old, new = pool.allocate(2), pool.allocate(2)
    cache.insert([1] * 8, old)
    cache.insert([2] * 8, new)
    cache.match([1] * 8)  # touch: now [2]* is least recently used
    assert sorted(cache.evict(2)) == sorted(new)
    pool.release(new)
    path = cache.match([1] * 8)
    cache.lock(path)
    assert cache.evictable_pages() == 0
    assert cache.evict(5) == []
    cache.unlock(path)
    assert cache.evictable_pages() == 2
    freed = cache.evict(5)
    assert sorted(freed) == sorted(old)  # leaf first, then its parent
    pool.release(freed)
    cache.check_integrity(pool)


def test_integrity_check_catches_a_lost_page():
    pool, cache = setup()
    pool.allocate(1)  # taken and never accounted for
    with pytest.raises(AssertionError, match="pages"):
        cache.check_integrity(pool)


def test_unlock_without_lock_is_a_bug():
    pool, cache = setup()
    cache.insert([1] * 4, pool.allocate(1))
    with pytest.raises(AssertionError):
        cache.unlock(cache.match([1] * 4))
