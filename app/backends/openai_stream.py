"""Reading an OpenAI-compatible chat stream: server-sent events in, reply pieces out.

The wire format (`POST /v1/chat/completions` with `"stream": true`):

    data: {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}], ...}
    data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], ...}
    data: {"choices": [], "usage": {"prompt_tokens": 1200, "completion_tokens": 10,
           "prompt_tokens_details": {"cached_tokens": 1184}}}      <- stream_options.include_usage
    data: [DONE]

Where servers differ, and what is read:
- cached prompt tokens: `usage.prompt_tokens_details.cached_tokens` (vLLM with
  --enable-prompt-tokens-details, SGLang with --enable-cache-report, OpenAI), else llama.cpp's
  `timings.cache_n` (llama.cpp may also put `timings` on the final chunk, not in usage);
- thinking: `delta.reasoning_content` (vLLM, SGLang, llama.cpp, DeepSeek) or `delta.reasoning`
  (newer vLLM, Ollama). It is wrapped in `<think>…</think>` so the reply text has the same
  shape as a local reasoning model's and `app.models.reasoning` splits it the same way;
- an error after the stream started: `data: {"error": {...}}` (vLLM, SGLang), or an
  `error:` field (llama.cpp); it ends the reply as a failure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from app.backends.remote_errors import detail_of
from app.models.reasoning import CLOSE_TAG, OPEN_TAG

DONE = object()  # the `[DONE]` sentinel


class StreamError(Exception):
    """The server reported an error inside the stream; the message is its own words."""


def sse_payloads(lines: Iterable[str]) -> Iterator[object]:
    """Each event's JSON payload (or DONE), from the stream's lines. Comments (`: ping`),
    `event:`/`id:` fields and blank keep-alives are skipped; an `error:` field or a payload
    with an "error" key raises StreamError."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield _payload("\n".join(data))
                data = []
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            if value.strip() == "[DONE]":  # servers send it without the blank line at times
                yield DONE
                data = []
                continue
            data.append(value)
        elif name == "error":
            raise StreamError(_error_text(value))
    if data:
        yield _payload("\n".join(data))


def _payload(text: str) -> object:
    try:
        payload = json.loads(text)
    except ValueError:
        raise StreamError(f"the server sent something that is not JSON: {text[:120]!r}") from None
    if isinstance(payload, dict) and payload.get("error"):
        raise StreamError(detail_of(payload) or json.dumps(payload["error"])[:300])
    return payload


def _error_text(value: str) -> str:
    try:
        return detail_of({"error": json.loads(value)}) or value.strip()
    except ValueError:
        return value.strip()


@dataclass
class ReplyAssembly:
    """The reply so far, built from chunks: `add(chunk)` returns the visible text each chunk
    adds (reasoning wrapped in think tags), and keeps the finish reason and usage."""

    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    content_chunks: int = 0  # chunks that carried text: a rough completion count without usage
    _in_reasoning: bool = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, chunk: object) -> str:
        if not isinstance(chunk, dict):
            return ""
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        out = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            out.append(self._delta_text(choice.get("delta") or {}))
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        piece = "".join(out)
        if piece:
            self.parts.append(piece)
            self.content_chunks += 1
        return piece

    def _delta_text(self, delta: dict) -> str:
        thinking = delta.get("reasoning_content") or delta.get("reasoning")
        content = delta.get("content")
        out = ""
        if isinstance(thinking, str) and thinking:
            if not self._in_reasoning and not self.parts:  # thinking only opens a reply
                out += OPEN_TAG
                self._in_reasoning = True
            out += thinking
        if isinstance(content, str) and content:
            if self._in_reasoning:
                out += CLOSE_TAG
                self._in_reasoning = False
            out += content
        return out


def cached_tokens(usage: dict | None, timings: dict | None) -> int:
    """Prompt tokens the server took from its prefix cache (0 when it does not say)."""
    details = (usage or {}).get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return timings["cache_n"]
    return 0


def prompt_tokens(usage: dict | None, timings: dict | None) -> int | None:
    """The whole prompt's tokens, cached ones included; None when the server does not say."""
    if isinstance((usage or {}).get("prompt_tokens"), int):
        return usage["prompt_tokens"]
    if isinstance(timings, dict) and isinstance(timings.get("prompt_n"), int):
        return timings["prompt_n"] + int(timings.get("cache_n") or 0)
    return None


def completion_tokens(usage: dict | None, timings: dict | None) -> int | None:
    if isinstance((usage or {}).get("completion_tokens"), int):
        return usage["completion_tokens"]
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        return timings["predicted_n"]
    return None
