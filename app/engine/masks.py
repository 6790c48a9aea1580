"""The attention mask, decided in one place for every KV layout."""

from __future__ import annotations

import torch


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
                   q_seq: torch.Tensor | None = None, k_seq: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """q_pos [S, T], k_pos [S, L] (-1 = padding) -> bool [S, 1, T, L], True = may attend.

    Causal; a sliding layer sees the last `window` positions, itself included
    (q - k < window), as Gemma 3 was trained. When several sequences share one row
    (q_seq [S, T] and k_seq [S, L] say which sequence each query and key belongs to), a
    query only sees keys of its own sequence."""
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    allowed = (k >= 0) & (k <= q)
    if window is not None:
        allowed &= (q - k) < window
    if q_seq is not None:
        allowed &= q_seq[:, :, None] == k_seq[:, None, :]
    return allowed[:, None]
