"""The attention mask, decided in one place for every KV layout."""

from __future__ import annotations

import torch


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q_pos [S, T], k_pos [S, L] (-1 = padding) -> bool [S, 1, T, L], True = may attend.

    Causal; a sliding layer sees the last `window` positions, itself included
    (q - k < window), as Gemma 3 was trained. Each row s is one sequence (the paged view
    attends per sequence, so no query ever sees another sequence's keys)."""
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    allowed = (k >= 0) & (k <= q)
    if window is not None:
        allowed &= (q - k) < window
    return allowed[:, None]
