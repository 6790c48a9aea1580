"""Per-request logits processors (see `sampling.LogitsProcessor`): each function here returns a
factory for `SamplingParams.logits_processors`, which makes one request's processor.

- `logit_bias`: OpenAI's logit_bias. A bias is added to the token's score; -100 bans the
  token outright and +100 forces it (the reply picks among the +100 tokens only), as OpenAI
  describes those two values, rather than hoping that 100 outweighs every other score.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

BAN, FORCE = -100.0, 100.0


def logit_bias(bias: Mapping[int, float]) -> Callable[[], "LogitBias"]:
    """bias: token id -> value in [-100, 100] (ids checked against the vocabulary by the
    caller). The processor keeps no state, so one instance serves every request."""
    processor = LogitBias(bias)
    return lambda: processor


class LogitBias:
    def __init__(self, bias: Mapping[int, float]):
        for token, value in bias.items():
            if token < 0 or not BAN <= value <= FORCE or math.isnan(value):
                raise ValueError(f"logit_bias: token {token} has bias {value}; ids must be "
                                 "0 or more and biases in [-100, 100]")
        self._ids = torch.tensor(sorted(bias), dtype=torch.long)
        self._values = torch.tensor([float(bias[t]) for t in sorted(bias)])
        self._values[self._values <= BAN] = -math.inf
        self._forced = torch.tensor(sorted(t for t, v in bias.items() if v >= FORCE),
                                    dtype=torch.long)

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> [V]; ids beyond V (a caller's mistake) raise IndexError."""
        if len(self._ids):
            logits.index_add_(0, self._ids, self._values)
        if len(self._forced):
            kept = logits.index_select(0, self._forced)
            logits.fill_(-math.inf)
            logits.index_copy_(0, self._forced, kept)
        return logits
