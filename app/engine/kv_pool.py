"""The paged KV pool's tensors, each running sequence's contiguous copy, and the `KVView` one
forward pass sees of them.

Two layouts, one truth at a time:

* The pool (shared): per layer, keys and values live in flat slot tensors
  [num_pages * page_size, Hkv, D] on the model's device, allocated once. A sequence's page
  table maps position p to slot `pages[p // page_size] * page_size + p % page_size`. Page 0
  is zeroed and never handed out. The radix cache shares pages between sequences, the disk
  cache reads and writes whole pages, and the engine publishes finished pages here.
* A `SequenceKV` per running sequence (what attention reads): the same keys and values laid
  out contiguously, [n_layers, 2, Hkv, capacity, D] with capacity = its page table's
  positions. An adopted (shared) prefix or pages read back from disk are copied in from the
  pool once, when the sequence is first seen; each pass then writes its new keys into the
  copy alone. Attention reads a plain slice [Hkv, first:end, D] (a view: no gather, no
  copy), so a decode step costs its context's attention and nothing more. Before this
  layout every step gathered every visible page into a fresh tensor: at 3,000 positions
  that gather and the slow strided attention it fed cost ~4 ms a layer against ~0.5 ms for
  the slice (2 cores, SmolLM2's 3 x 64 KV heads).

While a sequence runs, its copy is the truth for the positions it computed; the pool gets
them when the copy is handed back (`forget(key, write_back=True)`: one `index_copy_` per
layer and K/V for the whole reply), which the engine does before publishing the pages.
Writing the pool every pass as well cost six small operations a layer (~0.5 ms of a 13 ms
SmolLM2 decode step) for pages nobody reads until the sequence ends: the radix cache, the
disk cache and eviction only ever see finished sequences' pages. A view without keys (tests,
warm-up) makes copies for one pass, so it writes the pool every pass. The copies double the
KV memory of the running sequences only.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

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
        self.dtype = dtype
        slots = num_pages * page_size
        shape = (slots, kv.n_kv_heads, kv.head_dim)
        # empty, not zeros: untouched pages cost no memory until a request writes them.
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(kv.n_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(kv.n_layers)]
        for t in (*self.keys, *self.values):
            t[:page_size].zero_()
        self._sequences: dict[Hashable, SequenceKV] = {}

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

    # ---- running sequences' contiguous copies --------------------------------------------

    def sequence(self, key: Hashable, table: Sequence[int]) -> SequenceKV:
        """The contiguous copy kept for sequence `key` (made on first use). A key seen with
        another page table gets a fresh copy: the table is the sequence's identity."""
        seq = self._sequences.get(key)
        if seq is None or seq.table != tuple(table):
            seq = self._sequences[key] = SequenceKV(self, table, len(table) * self.page_size)
        return seq

    def forget(self, key: Hashable, write_back: bool = False) -> None:
        """Sequence `key` has ended: drop its copy. `write_back`: first write the positions
        it computed into its pages, which are about to be published."""
        seq = self._sequences.pop(key, None)
        if seq is not None and write_back:
            seq.write_back(self)

    def forget_all(self) -> None:
        self._sequences.clear()

    @property
    def sequences_held(self) -> int:
        return len(self._sequences)


class SequenceKV:
    """One sequence's keys and values, contiguous: `data` [n_layers, 2, Hkv, capacity, D]
    (index 0 keys, 1 values). Positions [0, filled) equal the pool's at this sequence's
    slots or were computed into this copy; positions [0, in_pool) are also in the pool.
    `sync` copies positions the pool has and this copy lacks in, once; `write_back` writes
    the ones the pool lacks out."""

    __slots__ = ("table", "data", "filled", "in_pool", "layers")

    def __init__(self, pool: PagedKVPool, table: Sequence[int], capacity: int):
        kv = pool.kv
        self.table = tuple(table)
        self.data = torch.empty((kv.n_layers, 2, kv.n_kv_heads, capacity, kv.head_dim),
                                device=pool.device, dtype=pool.dtype)
        # Per layer (both [2, Hkv, capacity, D], keys [1, Hkv, capacity, D], values the same),
        # views made once: attention writes and reads them for every sequence in every layer
        # of every pass, and these shapes need no further view to do either.
        self.layers = [(self.data[i], self.data[i, 0:1], self.data[i, 1:2])
                       for i in range(kv.n_layers)]
        self.filled = 0
        self.in_pool = 0

    def sync(self, pool: PagedKVPool, upto: int) -> None:
        """Make positions [0, upto) equal the pool's (an adopted prefix, pages read back from
        disk, or everything for a copy made for one pass)."""
        start = self.filled
        if upto > start:
            slots = torch.tensor(pool.slots(self.table, start, upto), device=pool.device)
            for layer in range(len(pool.keys)):
                # [L, Hkv, D] -> [Hkv, L, D]
                self.data[layer, 0, :, start:upto] = pool.keys[layer].index_select(0, slots).transpose(0, 1)
                self.data[layer, 1, :, start:upto] = pool.values[layer].index_select(0, slots).transpose(0, 1)
            if self.in_pool == start:
                self.in_pool = upto
        self.filled = upto

    def write_back(self, pool: PagedKVPool) -> None:
        """Write positions [in_pool, filled) into the pool at this sequence's slots."""
        start, end = self.in_pool, self.filled
        if end > start:
            slots = torch.tensor(pool.slots(self.table, start, end), device=pool.device)
            for layer, (_, keys, values) in enumerate(self.layers):
                # [1, Hkv, L, D] -> rows [L, Hkv, D]
                pool.keys[layer].index_copy_(0, slots, keys[0, :, start:end].transpose(0, 1))
                pool.values[layer].index_copy_(0, slots, values[0, :, start:end].transpose(0, 1))
        self.in_pool = end


class PagedBatchView:
    """One forward pass over several sequences packed into one row of N tokens.

    Sequence i has page table `tables[i]`, already holds positions [0, starts[i]) and adds
    `counts[i]` tokens this pass (1 for a decode step, a chunk for a prefill), so decode
    steps and a prefill chunk share one pass over the weights: the model sees tokens [1, N].

    Attention is per sequence, never across the packed row (which would score every query
    against every sequence's keys: B streams would cost B times the sum of their contexts):
    each sequence's queries [1, H, n, D] attend to a slice of its own contiguous copy
    [1, Hkv, L, D], so a pass costs the sum of its sequences' contexts with no padding and no
    gather. A decode step sees every position of its slice (no mask); a prefill chunk gets a
    causal mask, built once per pass and layer kind (global, or sliding with a window); a
    sliding layer's slice starts where its oldest query's window does.

    `keys` names the sequences (the engine passes its requests) so their copies outlive the
    pass; without keys each sequence gets a copy for this pass alone (tests, warm-up).
    """

    def __init__(self, pool: PagedKVPool, tables: Sequence[Sequence[int]],
                 starts: Sequence[int], counts: Sequence[int],
                 keys: Sequence[Hashable] | None = None):
        self.pool = pool
        self.tables, self.starts, self.counts = tables, starts, counts
        device = pool.device
        write, q_pos, offsets, seqs = [], [], [], []
        for i, (table, start, n) in enumerate(zip(tables, starts, counts)):
            offsets.append(len(q_pos))
            if keys is None:
                write += pool.slots(table, start, start + n)
            q_pos += range(start, start + n)
            seq = (pool.sequence(keys[i], table) if keys is not None
                   else SequenceKV(pool, table, start + n))
            seq.sync(pool, start)
            seq.filled = start + n  # this pass writes them, in every layer
            seqs.append(seq)
        self._offsets = offsets  # first packed row of each sequence
        self._seqs = seqs
        # One-pass copies die with the pass, so their new rows go to the pool now too;
        # keyed copies write theirs back when they are forgotten.
        self._write_slots = torch.tensor(write, device=device) if keys is None else None
        self.q_pos = torch.tensor([q_pos], device=device)  # [1, N]
        self._plans: dict[int | None, list[tuple]] = {}
        self._decode_plans: dict[int | None, tuple] = {}

    def positions(self) -> torch.Tensor:
        return self.q_pos

    def last_token_rows(self) -> list[int]:
        """Index in the packed row of each sequence's last token (where its logits are)."""
        return [offset + n - 1 for offset, n in zip(self._offsets, self.counts)]

    def _plan(self, window: int | None) -> list[tuple]:
        """Per sequence, (start, n, first, seen, mask) for the layers with this `window`
        (None: global): its n new positions from `start`, and the `seen` positions from
        `first` its queries attend to (a sliding layer's slice starts where its oldest
        query's window does), with the causal mask of a prefill chunk or None for a decode
        step, which sees its whole slice. The same in every layer of a kind, so made once a
        pass: the loop in `attend` runs for every sequence in every layer."""
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = []
            device = self.pool.device
            for start, n in zip(self.starts, self.counts):
                first = max(0, start - window + 1) if window is not None else 0
                mask = None
                if n > 1:
                    q_pos = torch.arange(start, start + n, device=device)[None]
                    k_pos = torch.arange(first, start + n, device=device)[None]
                    mask = attention_mask(q_pos, k_pos, window)  # [1, 1, n, seen]
                plan.append((start, n, first, start + n - first, mask))
        return plan

    def decode_plan(self, window: int | None
                    ) -> tuple[list[torch.Tensor], list[int], list[int], list[int]] | None:
        """For a pass of decode steps alone (every sequence adds one token to a copy that
        outlives the pass), what `attend` does in the layers with this `window`, for a
        caller that writes and attends itself (the model's scripted decode step,
        app.models.decode_step): per sequence its copy `data` [n_layers, 2, Hkv, capacity,
        D], the position the step writes, and the first and the number of positions its
        query sees. None for any other pass (a prompt chunk, copies for one pass)."""
        if self._write_slots is not None or any(n != 1 for n in self.counts):
            return None
        plan = self._decode_plans.get(window)
        if plan is None:
            rows = self._plan(window)
            plan = self._decode_plans[window] = (
                [seq.data for seq in self._seqs], [start for start, *_ in rows],
                [first for _, _, first, _, _ in rows], [seen for *_, seen, _ in rows])
        return plan

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, attention) -> torch.Tensor:
        # q [1, H, N, D]; k, v [1, Hkv, N, D]. Each sequence's copy gets its own [Hkv, n, D]
        # at positions [start, start + n); without keys the pool gets rows [N, Hkv, D] too.
        # This runs per layer and, inside, per sequence: every operation in the loop is paid
        # B times a layer, so the loop holds only views, one copy and the attention.
        if self._write_slots is not None:  # (index_copy_ does not convert: V may be bfloat16)
            dtype = self.pool.dtype
            self.pool.keys[layer].index_copy_(0, self._write_slots, k[0].transpose(0, 1).to(dtype))
            self.pool.values[layer].index_copy_(0, self._write_slots, v[0].transpose(0, 1).to(dtype))
        # The queries meet the keys in the cache's dtype: converted once here, not per
        # sequence; the output stays in it (see KVView).
        if q.dtype != self.pool.dtype:
            q = q.to(self.pool.dtype)
        plan = self._plan(window)
        if len(self._seqs) == 1:
            (start, n, first, seen, mask), = plan
            _, keys, values = self._seqs[0].layers[layer]  # [1, Hkv, capacity, D]
            keys.narrow(2, start, n).copy_(k)
            values.narrow(2, start, n).copy_(v)
            return attention(q, keys.narrow(2, first, seen), values.narrow(2, first, seen), mask)
        # Each sequence's queries and new keys and values, as views of the packed row (one
        # split each, not a view per sequence); [2, Hkv, n, D]: one copy writes both.
        queries = q.split_with_sizes(self.counts, 2)
        news = torch.cat((k, v)).split_with_sizes(self.counts, 2)
        outs = []
        for seq, q_i, new, (start, n, first, seen, mask) in zip(self._seqs, queries, news, plan):
            both, keys, values = seq.layers[layer]
            both.narrow(2, start, n).copy_(new)
            outs.append(attention(q_i, keys.narrow(2, first, seen), values.narrow(2, first, seen), mask))
        # Sequences are packed in order, so their outputs concatenate into the packed row.
        return torch.cat(outs, dim=2)
