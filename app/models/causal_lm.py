"""The interface between a model and everything that runs it.

The engine, KV pool, contiguous cache, bench and generate depend on these two small types
only, never on a model family: a new family implements `CausalLM` and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVFacts:
    """What a KV cache must know to hold a model's keys and values.

    `windows[i]` is how many most recent positions (itself included) a query of layer i may
    see, or None for a global layer."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.windows) != self.n_layers:
            raise ValueError(f"{len(self.windows)} layer windows for {self.n_layers} layers")

    def window(self, layer: int) -> int | None:
        return self.windows[layer]

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


# attention(q [S, H, T, D], keys [S, Hkv, L, D], values [S, Hkv, L, D], mask [S, 1, T, L]
# or None) -> [S, H, T, D]: the model's own attention (scale, grouped heads, soft-capping),
# which a KV view calls for each group of queries that attend together. A mask of None means
# every query may see every key given (a decode step over exactly its visible keys). Keys
# and values may be strided views (e.g. a slice of a longer buffer); their last dim is dense.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class KVView(Protocol):
    """Where a forward pass stores the new keys/values and attends to all the visible ones.

    `attend` is called once per layer with this step's queries q [S, H, T, D] and keys and
    values k, v [S, Hkv, T, D]. It stores k and v, then calls `attention` on the queries with
    every position they may see (the new ones included) and a boolean mask (True = may
    attend) that already applies causality, padding and the layer's sliding `window` (None
    for a global layer), or no mask (None) when every query may see every key it is given; it may do so in several groups (e.g. one per sequence) and returns
    the output [S, H, T, D] in q's layout, in q's dtype or the cache's (a bfloat16 cache's
    output goes on to a 4-bit product, which takes bfloat16).
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, attention: Attention) -> torch.Tensor: ...


class CausalLM(Protocol):
    """A decoder-only language model that keeps no KV state of its own."""

    kv_facts: KVFacts
    vocab_size: int
    compute_dtype: torch.dtype  # activations and KV; weights may be narrower

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVView) -> torch.Tensor:
        """tokens, positions: [S, T] int64 -> final-normed hidden states [S, T, d]."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> float32 logits [..., V]."""
        ...
