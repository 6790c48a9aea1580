"""One request, start to finish, on the engine: the headless `generate` path.

The engine is stepped on the calling thread (no runner thread needed for one request);
text leaves through `on_text` as it becomes safe to show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.engine import Engine, EngineConfig
from app.engine.events import Failed, Finished, Token, Usage
from app.engine.sampling import SamplingParams, TokenChoice
from app.models.loader import LoadedModel


class GenerationError(ValueError):
    """The engine refused or failed the request; the message says why."""


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    completion: list[TokenChoice] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    usage: Usage | None = None
    prefill_seconds: float = 0.0
    decode_tokens_per_s: float = 0.0

    @property
    def completion_ids(self) -> list[int]:
        return [c.id for c in self.completion]


def engine_for_one(loaded: LoadedModel, prompt_len: int, params: SamplingParams,
                   prefill_chunk: int) -> Engine:
    """An engine whose KV pool holds exactly one request of this size."""
    page_size = 16
    tokens = max(prompt_len, 1) + params.max_tokens
    kv_tokens = max(2, -(-tokens // page_size)) * page_size
    return Engine(loaded, EngineConfig(page_size=page_size, kv_tokens=kv_tokens,
                                       prefill_chunk=prefill_chunk))


def run_to_completion(engine: Engine, prompt_ids: list[int], params: SamplingParams,
                      on_text: Callable[[str], None] | None = None) -> GenerationResult:
    result = GenerationResult(prompt_ids=list(prompt_ids))
    request_id = engine.submit(prompt_ids, params)
    while True:
        for event in engine.step():
            if event.request_id != request_id:
                continue
            if isinstance(event, Failed):
                raise GenerationError(event.message)
            if isinstance(event, Token):
                result.completion.append(
                    TokenChoice(event.token_id, event.logprob, event.top_logprobs))
                if event.text:
                    result.text += event.text
                    if on_text:
                        on_text(event.text)
            elif isinstance(event, Finished):
                result.finish_reason = event.finish_reason
                result.usage = event.usage
                result.prefill_seconds = event.timings.prefill_s
                result.decode_tokens_per_s = event.timings.decode_tokens_per_s
                return result


def generate(loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams,
             prefill_chunk: int = 512, on_text: Callable[[str], None] | None = None
             ) -> GenerationResult:
    if prefill_chunk < 1:
        raise ValueError("prefill chunk size must be at least 1")
    engine = engine_for_one(loaded, len(prompt_ids), params, prefill_chunk)
    return run_to_completion(engine, prompt_ids, params, on_text)
