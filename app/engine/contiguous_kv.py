"""A contiguous KV cache for one sequence: the simplest `KVView`, and the reference the paged
pool is tested against.

Keys/values live in [1, Hkv, capacity, D] buffers per layer. `length` (positions written) is
the only cursor: a forward writes its T new positions at [length, length + T) in every layer,
then `commit(T)` advances it. Nothing else stores where a sequence is.
"""

from __future__ import annotations

import torch

from app.engine.masks import attention_mask
from app.models.causal_lm import KVFacts


class ContiguousKV:
    def __init__(self, kv: KVFacts, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (1, kv.n_kv_heads, capacity, kv.head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(kv.n_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(kv.n_layers)]
        self.capacity = capacity
        self.length = 0
        self._masks: dict[tuple[int | None, int], torch.Tensor] = {}

    def positions(self, n_new: int) -> torch.Tensor:
        """[1, n_new] positions of the next tokens, read off the cache."""
        if self.length + n_new > self.capacity:
            raise ValueError(f"{self.length + n_new} positions do not fit a cache of {self.capacity}.")
        return torch.arange(self.length, self.length + n_new,
                            device=self.keys[0].device)[None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, attention) -> torch.Tensor:
        T = k.shape[2]
        end = self.length + T
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        # A sliding layer only needs the keys its oldest query can still see.
        start = max(0, self.length - window + 1) if window is not None else 0
        mask = self._masks.get((window, T))
        if mask is None:
            device = k.device
            q_pos = torch.arange(self.length, end, device=device)[None]
            k_pos = torch.arange(start, end, device=device)[None]
            mask = self._masks[(window, T)] = attention_mask(q_pos, k_pos, window)
        return attention(q, self.keys[layer][:, :, start:end], self.values[layer][:, :, start:end], mask)

    def commit(self, n_new: int) -> None:
        """The forward that wrote `n_new` positions is complete."""
        self.length += n_new
        self._masks.clear()
