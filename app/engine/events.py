"""What the engine reports about each request: plain, frozen data that can cross threads.

Every request sees, in order: `Queued`, then `PrefillProgress` (one or more), then `Token`s,
then exactly one `Finished` -- or `Failed` at any point after `Queued`. `Finished` carries
the usage and timings; `finish_reason` is "stop", "length" or "abort".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens adopted from the prefix cache, not recomputed
    completion_tokens: int
    restored_tokens: int = 0  # of `cached_tokens`, how many were read from the disk cache


@dataclass(frozen=True)
class Timings:
    queued_s: float = 0.0  # submit -> admitted
    prefill_s: float = 0.0  # admitted -> first token sampled
    time_to_first_token_s: float = 0.0  # submit -> first token sampled
    decode_s: float = 0.0  # first token -> finish
    decode_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class Event:
    request_id: str


@dataclass(frozen=True)
class Queued(Event):
    prompt_tokens: int


@dataclass(frozen=True)
class PrefillProgress(Event):
    done: int  # prompt tokens whose KV is ready (adopted ones included)
    total: int
    cached: int  # of `done`, how many were adopted from the cache
    restored: int = 0  # of `cached`, how many were read back from the disk cache


@dataclass(frozen=True)
class Token(Event):
    """One generated token and the text it made visible (possibly empty: held back while a
    multi-byte character or a stop string may still be forming). `token_id` is None when the
    backend does not say (a remote server streams text, not ids)."""

    token_id: int | None
    text: str
    logprob: float = float("nan")
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Finished(Event):
    finish_reason: str
    text: str  # the whole visible reply
    usage: Usage
    timings: Timings
    completion_ids: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class Failed(Event):
    message: str
    retry_after: float | None = None  # seconds the server asked to wait (429/503 Retry-After)
