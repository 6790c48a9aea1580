"""The paged KV pool's tensors, and the `KVView` one forward pass sees of it.

Per layer, keys and values live in flat slot tensors [num_pages * page_size, Hkv, D] on the
model's device, allocated once. A sequence's page table maps position p to slot
`pages[p // page_size] * page_size + p % page_size`. Page 0 is zeroed and never handed out
(a spare target for anything that must point somewhere).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.engine.masks import attention_mask
from app.models.causal_lm import KVFacts


class PagedKVPool:
    def __init__(self, kv: KVFacts, num_pages: int, page_size: int,
                 device: torch.device, dtype: torch.dtype):
        self.kv = kv
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        slots = num_pages * page_size
        shape = (slots, kv.n_kv_heads, kv.head_dim)
        # empty, not zeros: untouched pages cost no memory until a request writes them.
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(kv.n_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(kv.n_layers)]
        for t in (*self.keys, *self.values):
            t[:page_size].zero_()

    def slots(self, pages: Sequence[int], start: int, end: int) -> list[int]:
        """Slot of every position in [start, end) of a sequence with page table `pages`."""
        ps = self.page_size
        first, last = start // ps, (end - 1) // ps if end > start else start // ps - 1
        out: list[int] = []
        for i in range(first, last + 1):  # whole pages at a time: cheap for long contexts
            base = pages[i] * ps
            lo = max(start - i * ps, 0)
            hi = min(end - i * ps, ps)
            out.extend(range(base + lo, base + hi))
        return out


class PagedBatchView:
    """One forward pass over several sequences packed into one row of N tokens.

    Sequence i has page table `tables[i]`, already holds positions [0, starts[i]) and adds
    `counts[i]` tokens this pass (1 for a decode step, a chunk for a prefill), so decode
    steps and a prefill chunk share one pass over the weights: the model sees tokens [1, N].

    Attention is per sequence, never across the packed row (which would score every query
    against every sequence's keys: B streams would cost B times the sum of their contexts).
    Queries are split into groups, each attending to its own keys only:
      * a prefill chunk (count > 1) is one group: its queries [1, H, n, D] against its own
        visible keys [1, Hkv, L, D];
      * decode steps (count 1) are batched: queries [B, H, 1, D] against keys padded to the
        longest context in the group [B, Hkv, Lmax, D] (padding masked). Sequences are
        grouped by length (sorted, a new group when a context is more than twice the
        group's shortest plus a page) so padding never more than about doubles the work.
    So a pass costs the sum of its sequences' contexts. For each layer kind (global, or
    sliding with a window) the groups' gather plans and masks are built once and reused by
    every such layer; a sliding layer gathers only what its oldest query can still see.
    """

    def __init__(self, pool: PagedKVPool, tables: Sequence[Sequence[int]],
                 starts: Sequence[int], counts: Sequence[int]):
        self.pool = pool
        self.tables, self.starts, self.counts = tables, starts, counts
        device = pool.device
        write, q_pos, offsets = [], [], []
        for table, start, n in zip(tables, starts, counts):
            offsets.append(len(q_pos))
            write += pool.slots(table, start, start + n)
            q_pos += range(start, start + n)
        self._offsets = offsets  # first packed row of each sequence
        self._write_slots = torch.tensor(write, device=device)
        self.q_pos = torch.tensor([q_pos], device=device)  # [1, N]
        self._plans: dict[int | None, list[_Group]] = {}

    def positions(self) -> torch.Tensor:
        return self.q_pos

    def last_token_rows(self) -> list[int]:
        """Index in the packed row of each sequence's last token (where its logits are)."""
        return [offset + n - 1 for offset, n in zip(self._offsets, self.counts)]

    def _visible(self, i: int, window: int | None) -> tuple[int, int]:
        """[first, end) positions sequence i's queries may see this pass."""
        start, n = self.starts[i], self.counts[i]
        first = max(0, start - window + 1) if window is not None else 0
        return first, start + n

    def _plan(self, window: int | None) -> list[_Group]:
        plan = self._plans.get(window)
        if plan is not None:
            return plan
        device, pool = self.pool.device, self.pool
        plan = []
        decoding = []
        for i, n in enumerate(self.counts):
            first, end = self._visible(i, window)
            if n > 1:  # a prefill chunk: its own group
                slots = torch.tensor([pool.slots(self.tables[i], first, end)], device=device)
                q_pos = self.q_pos[:, self._offsets[i]: self._offsets[i] + n]
                k_pos = torch.arange(first, end, device=device)[None]
                plan.append(_Group(self._offsets[i], n, None, slots,
                                   attention_mask(q_pos, k_pos, window)))
            else:
                decoding.append((end - first, i))
        decoding.sort()
        while decoding:
            shortest = decoding[0][0]
            take = 1
            while take < len(decoding) and decoding[take][0] <= 2 * shortest + pool.page_size:
                take += 1
            group, decoding = decoding[:take], decoding[take:]
            longest = group[-1][0]
            # In packed order: a lone group covering every row then needs no scatter.
            group.sort(key=lambda item: item[1])
            slots, k_pos, q_pos, rows = [], [], [], []
            for length, i in group:
                first, end = self._visible(i, window)
                pad = longest - length
                slots.append(pool.slots(self.tables[i], first, end) + [0] * pad)  # slot 0: zeros
                k_pos.append(list(range(first, end)) + [-1] * pad)  # -1: masked
                q_pos.append([end - 1])
                rows.append(self._offsets[i])
            mask = attention_mask(torch.tensor(q_pos, device=device),
                                  torch.tensor(k_pos, device=device), window)
            plan.append(_Group(rows[0], 1, torch.tensor(rows, device=device),
                               torch.tensor(slots, device=device), mask))
        self._plans[window] = plan
        return plan

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, attention) -> torch.Tensor:
        # q [1, H, N, D]; k, v [1, Hkv, N, D] -> rows [N, Hkv, D] written at their slots
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys.index_copy_(0, self._write_slots, k[0].transpose(0, 1))
        values.index_copy_(0, self._write_slots, v[0].transpose(0, 1))
        plan = self._plan(window)
        out = None if len(plan) == 1 else torch.empty_like(q)
        for group in plan:
            # gathered [B, L, Hkv, D] -> [B, Hkv, L, D]
            k_g = keys[group.slots].transpose(1, 2)
            v_g = values[group.slots].transpose(1, 2)
            if group.rows is None:  # a prefill chunk: [1, H, n, D]
                result = attention(q.narrow(2, group.offset, group.count), k_g, v_g, group.mask)
                if out is None:
                    return result
                out.narrow(2, group.offset, group.count).copy_(result)
            else:  # decode steps: [1, H, B, D] <-> [B, H, 1, D]
                q_g = q.index_select(2, group.rows).transpose(0, 2)
                result = attention(q_g, k_g, v_g, group.mask).transpose(0, 2)
                if out is None:
                    return result.contiguous()
                out.index_copy_(2, group.rows, result)
        return out


class _Group:
    """Queries attending together: a prefill chunk (rows None: packed rows [offset,
    offset + count)) or decode steps (rows: one packed row each). slots [B, L] into the
    pool, mask [B, 1, T, L]."""

    __slots__ = ("offset", "count", "rows", "slots", "mask")

    def __init__(self, offset: int, count: int, rows: torch.Tensor | None, slots: torch.Tensor,
                 mask: torch.Tensor):
        self.offset, self.count, self.rows, self.slots, self.mask = offset, count, rows, slots, mask
