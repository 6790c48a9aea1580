"""One request's state as it moves through the engine: waiting -> prefill -> decode -> done.

The KV cursor is `written` (positions whose KV is in the pool); it is the only counter of
where a sequence is. A prefill's next chunk starts at `written` -- read off the KV, so a
request that adopted a cached prefix and a cold one take the same path (the seed's rule).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from app.engine.radix_cache import Node
from app.engine.sampling import RequestSampler, SamplingParams, TokenChoice
from app.engine.stops import StopMatcher


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]  # as submitted; its length is what usage reports
    params: SamplingParams
    stop_token_ids: frozenset[int]
    stream: object  # the tokenizer's StreamDecoder
    # What the model runs: the prompt, or BOS alone for an empty prompt (one forward pass
    # is still needed for the first token's logits).
    tokens: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    pages: list[int] = field(default_factory=list)  # page table: adopted pages, then own
    adopted: list[Node] = field(default_factory=list)  # locked radix nodes
    cached_tokens: int = 0
    written: int = 0
    # Disk-cache keys of the pages to read back before computing (see Engine._restore_some).
    restore_keys: list[str] = field(default_factory=list)
    restored_tokens: int = 0
    generated: list[TokenChoice] = field(default_factory=list)
    text: str = ""
    aborted: bool = False
    finish_reason: str | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0
    first_token_at: float = 0.0

    def __post_init__(self) -> None:
        self.sampler = RequestSampler(self.params)
        self.stops = StopMatcher(self.params.stop)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[len(self.adopted):]

    @property
    def prefill_remaining(self) -> int:
        return len(self.tokens) - self.written

    @property
    def sequence(self) -> list[int]:
        """Every token whose KV this request has written or will write next: the prompt,
        then each generated token (the newest one's KV is written by the next step)."""
        return self.tokens + [c.id for c in self.generated]

    def pages_needed(self, page_size: int) -> int:
        """Pages for the whole prompt plus the full reply budget, reserved at admission."""
        total = len(self.tokens) + self.params.max_tokens
        return -(-total // page_size)
