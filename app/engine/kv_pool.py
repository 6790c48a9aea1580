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
    steps and a prefill chunk share one pass over the weights. The model sees tokens
    [1, N]; each layer's keys are the concatenation of every sequence's visible positions,
    and the mask keeps each query within its own sequence. For each layer kind (global, or
    sliding with a window) the gather plan and mask are built once and reused by every
    such layer; a sliding layer gathers only what its oldest query can still see.
    """

    def __init__(self, pool: PagedKVPool, tables: Sequence[Sequence[int]],
                 starts: Sequence[int], counts: Sequence[int]):
        self.pool = pool
        self.tables, self.starts, self.counts = tables, starts, counts
        device = pool.device
        write, q_pos, q_seq = [], [], []
        for i, (table, start, n) in enumerate(zip(tables, starts, counts)):
            write += pool.slots(table, start, start + n)
            q_pos += range(start, start + n)
            q_seq += [i] * n
        self._write_slots = torch.tensor(write, device=device)
        self.q_pos = torch.tensor([q_pos], device=device)  # [1, N]
        self.q_seq = torch.tensor([q_seq], device=device)
        self._reads: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def positions(self) -> torch.Tensor:
        return self.q_pos

    def last_token_rows(self) -> list[int]:
        """Index in the packed row of each sequence's last token (where its logits are)."""
        rows, end = [], 0
        for n in self.counts:
            end += n
            rows.append(end - 1)
        return rows

    def _read_plan(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._reads.get(window)
        if plan is None:
            slots, k_pos, k_seq = [], [], []
            for i, (table, start, n) in enumerate(zip(self.tables, self.starts, self.counts)):
                first = max(0, start - window + 1) if window is not None else 0
                slots += self.pool.slots(table, first, start + n)
                k_pos += range(first, start + n)
                k_seq += [i] * (start + n - first)
            device = self.pool.device
            mask = attention_mask(self.q_pos, torch.tensor([k_pos], device=device), window,
                                  self.q_seq, torch.tensor([k_seq], device=device))
            plan = self._reads[window] = (torch.tensor(slots, device=device), mask)
        return plan

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None):
        # k, v: [1, Hkv, N, D] -> rows [N, Hkv, D] written at their slots
        _, Hkv, N, D = k.shape
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys.index_copy_(0, self._write_slots, k[0].transpose(0, 1))
        values.index_copy_(0, self._write_slots, v[0].transpose(0, 1))
        slot_index, mask = self._read_plan(window)
        # gathered [L, Hkv, D] -> [1, Hkv, L, D]
        return (keys[slot_index].transpose(0, 1)[None], values[slot_index].transpose(0, 1)[None],
                mask)
