"""Sampling: `SamplingParams` travels unchanged from the UI or CLI to here, and becomes tensor
operations in exactly one function, `RequestSampler.next_token`.

Each request owns a `RequestSampler` with its own seeded generator and token counts, and a
row's logits are sampled on their own, so the same seed gives the same tokens whatever else
shares the batch. Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which
draws exactly from p without `torch.multinomial` (buggy on MPS at times) and needs only one
noise draw per candidate token, made on the CPU so a seed means the same thing on every device.

The sampler is total: whatever values pass `SamplingParams`' checks (temperature 1e-300,
repetition_penalty 1e-300, every token but one banned) it returns a token or raises
`NoTokenAllowed` for that request alone; overflowing scores never reach softmax as NaN.

`logits_processors` is the one generic hook for per-request constraints (a logit bias, a
grammar): factories, each making one request's processor, which may keep state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

_FLOAT_MAX = torch.finfo(torch.float32).max
_TINY_TEMPERATURE = 1e-30


class LogitsProcessor(Protocol):
    """Reshapes one request's next-token scores. `generated`: the tokens this request has
    sampled so far (the newest last); `logits`: [V] float32. Returns [V] float32 (it may
    change `logits` in place); -inf bans a token."""

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor: ...


class NoTokenAllowed(ValueError):
    """Every token was banned (by a bias or a constraint): this request cannot go on."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 512
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 64  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens already seen
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None = a fresh random seed per request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0  # how many alternatives to report per token (0 = none)
    ignore_eos: bool = False
    # Factories, one processor per request each (see LogitsProcessor); applied in order.
    logits_processors: tuple[Callable[[], LogitsProcessor], ...] = ()

    def __post_init__(self) -> None:
        numbers = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")
        for name in numbers:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be 0 (greedy) or more"),
            (self.top_k >= 0, "top_k must be 0 (off) or more"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be positive"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be between 0 and 20"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenChoice:
    """One sampled token with its log-probability under the model (before any shaping)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


_MAX_BLOCK = 512


def _best(logits: torch.Tensor, greedy: bool) -> tuple[float, int | None]:
    """The largest logit and, for greedy, the index of its first occurrence (as argmax);
    a NaN anywhere comes out as the value (and its first index), as one max propagates it.

    On the CPU through numpy's argmax, whose SIMD loop keeps the first maximal entry and
    stops at the first NaN, the same value and index as torch's max: 49,152 logits on a
    2-core CPU in ~5 us against ~50 for torch's `max(0)` (a scalar loop: one logit a
    cycle), 262,144 in ~22 against ~145 for its maxima of blocks. Elsewhere (a GPU's
    logits) in two levels: the maximum of each block of 512, then of those, as fast as
    the blocks' maxima run in parallel there."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.detach().numpy()
        index = int(values.argmax())
        return float(values[index]), index if greedy else None
    n = logits.numel()
    head = n - n % _MAX_BLOCK
    if head < 2 * _MAX_BLOCK:
        value, index = logits.max(0)
        return float(value), int(index) if greedy else None
    values, indices = logits[:head].reshape(-1, _MAX_BLOCK).max(1)
    value, block = values.max(0)
    best = float(value)
    index = int(block) * _MAX_BLOCK + int(indices[block]) if greedy else None
    if head < n:  # a vocabulary that is no multiple of the block: its last few logits
        tail_value, tail_index = logits[head:].max(0)
        tail = float(tail_value)
        if tail > best or (math.isnan(tail) and not math.isnan(best)):
            best, index = tail, head + int(tail_index) if greedy else None
    return best, index


# Exact top-k through a candidate set (`_top`) from this many logits on; below, torch's topk.
_CANDIDATES_FROM = 8_192
_SAMPLE = 1_024  # about this many logits sampled to set the candidates' threshold


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of finite (or -inf) float32 `logits` [V], descending, and their ids:
    torch's `topk(logits, k)` (which of equal values at the cut is kept may differ).

    On the CPU, torch's topk over 49,152 logits takes ~100 us (~0.3 ms over 262,144), a
    sampled token's largest cost. So: a threshold read off a strided sample of ~1,024
    logits, set so ~2k logits reach it; every id at or above it (numpy's comparison, one
    pass); their top k. When fewer than k reach it (a row unlike its sample), the sample's
    threshold is lowered, and in the end the whole row is taken. A k of more than an eighth
    of the row (top-k off: the whole row) goes to torch's topk at once."""
    vocab = logits.numel()
    k = min(k, vocab)
    if (vocab < _CANDIDATES_FROM or k > vocab // 8 or logits.device.type != "cpu"
            or logits.dtype != torch.float32):
        return torch.topk(logits, k)
    row = logits.detach().numpy()
    stride = vocab // _SAMPLE
    sample = row[::stride]
    above = min(sample.size, 2 * k // stride + 2)  # sample values at or above the threshold
    while True:
        least = np.partition(sample, sample.size - above)[sample.size - above]
        ids = np.flatnonzero(row >= least)
        if ids.size >= k:
            break
        if above == sample.size:
            return torch.topk(logits, k)
        above = min(sample.size, above * 4)
    ids = torch.from_numpy(ids)
    values, chosen = torch.topk(logits.index_select(0, ids), k)
    return values, ids.index_select(0, chosen)


@dataclass
class RequestSampler:
    params: SamplingParams
    seed: int = field(init=False)
    _generated: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(self.seed)
        self._processors = [make() for make in self.params.logits_processors]
        # Every token seen (prompt and generated) once each, and how often, for the
        # penalties: numpy buffers grown by doubling, so a token's tensors are views (a
        # tensor built from a dict of a few hundred ids took ~80 us a token).
        self._positions: dict[int, int] = {}
        self._seen_ids = np.zeros(64, np.int64)
        self._seen_counts = np.zeros(64, np.float32)

    def observe(self, token_ids) -> None:
        """Count tokens for the penalties (the prompt's and every generated one)."""
        for t in token_ids:
            at = self._positions.get(t)
            if at is None:
                at = self._positions[t] = len(self._positions)
                if at == self._seen_ids.size:
                    self._seen_ids = np.concatenate([self._seen_ids, np.zeros_like(self._seen_ids)])
                    self._seen_counts = np.concatenate([self._seen_counts,
                                                        np.zeros_like(self._seen_counts)])
                self._seen_ids[at] = t
            self._seen_counts[at] += 1

    def next_token(self, logits: torch.Tensor) -> TokenChoice:
        """logits: [V] float32 for one request -> the chosen token (also counted).
        Raises NoTokenAllowed when the processors left no token."""
        p = self.params
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1) if p.top_logprobs else None
        shaped = logits
        for process in self._processors:
            shaped = process(self._generated, shaped if shaped is not logits else logits.clone())
        shaped = self._penalized(shaped)
        best, best_index = _best(shaped, p.greedy)
        if not math.isfinite(best):
            # Extreme penalties overflow: +inf becomes the largest float (still the favourite),
            # NaN a banned token, so nothing below ever sees inf - inf. Only here: a finite
            # best means no NaN (max propagates it) and no +inf, so this would change nothing
            # (one pass over the vocabulary saved a token, 4 MB of traffic for four streams).
            shaped = torch.nan_to_num(shaped, nan=-math.inf, posinf=_FLOAT_MAX, neginf=-math.inf)
            best, best_index = _best(shaped, p.greedy)
        if best == -math.inf:
            raise NoTokenAllowed("no token is allowed here: every token was banned by "
                                 "logit_bias or the output format's constraint")
        if p.greedy:
            token = best_index
        else:
            # Shifted so the best score is 0 before dividing: a tiny temperature sends the
            # others to -inf (greedy in effect), never the best one to inf. The divisor stays
            # a normal float32 (1e-300 would round to 0, and 0 / 0 is NaN).
            token = self._race(shaped, best, max(p.temperature, _TINY_TEMPERATURE))
        self.observe((token,))
        self._generated.append(token)
        if logprobs is None:
            return TokenChoice(token, float("nan"))
        values, ids = torch.topk(logprobs, p.top_logprobs)
        top = tuple(zip(ids.tolist(), values.tolist()))
        return TokenChoice(token, float(logprobs[token]), top)

    def _penalized(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        n = len(self._positions)
        if not n or (p.repetition_penalty == 1 and not p.presence_penalty
                     and not p.frequency_penalty):
            return logits
        ids = torch.from_numpy(self._seen_ids[:n]).to(logits.device)
        counts = torch.from_numpy(self._seen_counts[:n]).to(logits.device, logits.dtype)
        seen = logits.index_select(0, ids)
        if p.repetition_penalty != 1:
            seen = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        seen = seen - p.presence_penalty - p.frequency_penalty * counts
        return logits.index_copy(0, ids, seen)

    def _race(self, shaped: torch.Tensor, best: float, temperature: float) -> int:
        """Top-k, softmax, top-p, min-p, then the exponential race over what is left, of
        (shaped - best) / temperature: top-k is taken on `shaped` (the same order) and only
        the chosen are scaled."""
        p = self.params
        vocab = shaped.numel()
        k = min(p.top_k, vocab) if p.top_k else vocab
        if k == vocab and (p.top_p < 1 or p.min_p > 0):
            values, ids, probs = self._probe((shaped - best) / temperature)
        else:
            values, ids = _top(shaped, k)  # sorted, descending
            values = (values - best) / temperature
            # softmax as `_probe` computes it (torch.softmax's vectorised exp differs from
            # torch.exp by ~1e-5 on some CPUs, enough to flip a race between near-equals)
            probs = torch.exp(values - values[0])
            probs = probs / probs.sum()
        keep = torch.ones_like(probs, dtype=torch.bool)
        if p.top_p < 1:
            before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
            keep &= before < p.top_p
        if p.min_p > 0:
            keep &= probs >= p.min_p * probs[0]
        n = int(keep.sum())  # kept tokens are a prefix of the sorted list
        probs = probs[:n].cpu()
        noise = torch.empty(n).exponential_(generator=self._generator).clamp_min_(1e-30)
        return int(ids[int(torch.argmax(probs / noise))])

    _PROBE = 256

    def _probe(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k off but top-p or min-p on: sorting the whole vocabulary (7 ms a token for
        49k entries on a 2-core CPU, every API request's default) is only needed when the
        cut falls that deep. The best 256, 2,048, ... candidates are taken until one
        candidate past the cut is among them, with probabilities normalised over the whole
        vocabulary, so what is kept (and the race over it) is what a full sort keeps."""
        p = self.params
        vocab = logits.numel()
        best = logits.max()
        total = torch.exp(logits - best).sum()  # softmax's own normaliser
        m = self._PROBE
        while True:
            values, ids = _top(logits, m)
            probs = torch.exp(values - best) / total
            if m >= vocab:
                return values, ids, probs
            # The last candidate is cut by top-p (the mass above it reaches top_p) or by
            # min-p; then so is everything below it.
            above_last = float(probs[:-1].sum())
            if (p.top_p < 1 and above_last >= p.top_p) or (
                    p.min_p > 0 and float(probs[-1]) < p.min_p * float(probs[0])):
                return values, ids, probs
            m *= 8
