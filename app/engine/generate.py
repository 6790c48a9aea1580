"""One request, start to finish, on a contiguous cache: the headless `generate` path.

Prefill runs in chunks of at most `prefill_chunk` tokens, each starting where the cache says
it is (`kv.length`); decode then samples one token at a time until a stop token, a stop
string or `max_tokens`. Text leaves through `on_text` as it becomes safe to show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.engine.contiguous_kv import ContiguousKV
from app.engine.sampling import RequestSampler, SamplingParams, TokenChoice
from app.engine.stops import StopMatcher
from app.models.loader import LoadedModel


class PromptTooLongError(ValueError):
    """The prompt plus the reply's budget does not fit the model's context."""


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    completion: list[TokenChoice] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def completion_ids(self) -> list[int]:
        return [c.id for c in self.completion]

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from the prefill's logits; the rest each cost one decode step.
        steps = len(self.completion) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


def check_fits(prompt_len: int, max_tokens: int, context_length: int) -> None:
    if prompt_len + max_tokens > context_length:
        raise PromptTooLongError(
            f"The prompt has {prompt_len:,} tokens and the reply may take {max_tokens:,} more, "
            f"but the model's context holds {context_length:,}. Shorten the prompt or lower "
            f"max tokens by {prompt_len + max_tokens - context_length:,}.")


@torch.inference_mode()
def generate(loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams,
             prefill_chunk: int = 512, on_text: Callable[[str], None] | None = None
             ) -> GenerationResult:
    if prefill_chunk < 1:
        raise ValueError("prefill chunk size must be at least 1")
    model, tokenizer = loaded.model, loaded.tokenizer
    # An empty prompt still runs one forward pass, on BOS, so the first token has logits.
    tokens = list(prompt_ids) or [tokenizer.bos_id]
    check_fits(len(tokens), params.max_tokens, loaded.context_length)
    kv = ContiguousKV(loaded.config, len(tokens) + params.max_tokens, loaded.device,
                      loaded.compute_dtype)
    result = GenerationResult(prompt_ids=list(prompt_ids))
    sampler = RequestSampler(params)
    sampler.observe(tokens)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else loaded.stop_token_ids)
    stops = StopMatcher(params.stop)
    stream = tokenizer.stream_decoder()

    start = time.perf_counter()
    while kv.length < len(tokens):
        chunk = tokens[kv.length: kv.length + prefill_chunk]
        logits = _forward(loaded, kv, chunk)
    result.prefill_seconds = time.perf_counter() - start

    start = time.perf_counter()
    while True:
        choice = sampler.next_token(logits)
        result.completion.append(choice)
        if choice.id in stop_ids:
            result.finish_reason = "stop"
            break
        visible = stops.feed(stream.push(choice.id))
        _emit(result, visible, on_text)
        if stops.stopped:
            result.finish_reason = "stop"
            break
        if len(result.completion) >= params.max_tokens:
            break
        logits = _forward(loaded, kv, [choice.id])
    result.decode_seconds = time.perf_counter() - start
    if not stops.stopped:
        _emit(result, stops.feed(stream.flush()) + stops.flush(), on_text)
    return result


def _forward(loaded: LoadedModel, kv: ContiguousKV, chunk: list[int]) -> torch.Tensor:
    """Run `chunk` at the positions the cache is at; return the last token's logits [V]."""
    positions = kv.positions(len(chunk))
    ids = torch.tensor([chunk], device=loaded.device)
    hidden = loaded.model(ids, positions, kv)
    kv.commit(len(chunk))
    return loaded.model.logits(hidden[0, -1])


def _emit(result: GenerationResult, text: str, on_text: Callable[[str], None] | None) -> None:
    if text:
        result.text += text
        if on_text:
            on_text(text)
