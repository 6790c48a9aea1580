"""The OpenAI wire format: request bodies (and the one place they become engine input),
response objects, and validation errors in OpenAI's shape.

Field ranges follow OpenAI's API reference, so a bad value is a 400 before anything runs.
Fields we have no use for (`user`, `metadata`, `tools`, ...) are accepted and ignored, as
clients send them routinely; what would silently change the answer and cannot be honoured
(`n` > 1, `best_of` > 1, `echo`) is refused. Sampling defaults are OpenAI's (temperature 1,
top_p 1, no top-k), not the app's, so a client gets what it expects from the API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.engine.events import Finished, Token, Usage
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message

DEFAULT_MAX_TOKENS = 4096  # reply budget when the request names none (capped by the context)


# ---- requests ----------------------------------------------------------------------------


class ApiError(Exception):
    """A request the API answers with an OpenAI-shaped error body and `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class SamplingFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # any name is accepted: the server runs one model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # Not OpenAI's, but common among local servers.
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported: this server returns one choice per request")
        return n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, top_logprobs: int) -> SamplingParams:
        """The engine's parameters; SamplingParams' own checks raise ValueError."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_given(self.temperature, 1.0),
            top_k=_given(self.top_k, 0),
            top_p=_given(self.top_p, 1.0),
            min_p=_given(self.min_p, 0.0),
            repetition_penalty=_given(self.repetition_penalty, 1.0),
            presence_penalty=_given(self.presence_penalty, 0.0),
            frequency_penalty=_given(self.frequency_penalty, 0.0),
            seed=self.seed,
            stop=stop,
            top_logprobs=top_logprobs,
        )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported; only 'text'")
        return kind


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def to_message(self) -> Message:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return Message("system" if self.role == "developer" else self.role, content or "")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives to report per token; None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    # A string or token ids; a batch of exactly one of either is unwrapped.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            return prompt[0]
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of is not None and best_of != 1:
            raise ValueError("only best_of=1 is supported")
        return best_of

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


def reply_budget(requested: int | None, prompt_tokens: int, context: int, prompt_param: str) -> int:
    """max_tokens for the engine: the request's, or what the context leaves (up to
    DEFAULT_MAX_TOKENS). A prompt plus reply that cannot fit the context is a 400 here, before
    anything is queued, rather than a failure mid-stream."""
    room = context - max(prompt_tokens, 1)  # an empty prompt still runs BOS
    if room < 1:
        raise ApiError(400, f"The prompt has {prompt_tokens:,} tokens but the model's context "
                            f"holds {context:,} (prompt and reply together). Shorten the prompt.",
                       param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return min(room, DEFAULT_MAX_TOKENS)
    if requested > room:
        raise ApiError(400, f"The model's context holds {context:,} tokens: the prompt takes "
                            f"{prompt_tokens:,} and max_tokens asks for {requested:,} more. "
                            f"Lower max_tokens to {room:,} or less, or shorten the prompt.",
                       param="max_tokens", code="context_length_exceeded")
    return requested


def _given(value, default):
    return default if value is None else value


# ---- responses ---------------------------------------------------------------------------


class ResponseFormat:
    """How one endpoint shapes its objects (OpenAI's `chat.completion`, `text_completion`
    and their stream chunks); one instance per request, for its id and offsets."""

    prefix = ""
    object = ""
    chunk_object = ""

    def __init__(self, model_id: str, tokenizer, logprobs: int | None, include_usage: bool):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.logprobs = logprobs  # alternatives per token; None = logprobs off
        self.include_usage = include_usage

    # Subclasses: the choice objects.
    def opening(self) -> list[dict]:
        return []

    def token_chunk(self, tokens: list[Token]) -> dict:
        raise NotImplementedError

    def end_chunk(self, finish_reason: str) -> dict:
        raise NotImplementedError

    def choice(self, tokens: list[Token], finished: Finished) -> dict:
        raise NotImplementedError

    # Shared envelopes.
    def chunk(self, choice: dict) -> dict:
        body = self._envelope(self.chunk_object, [choice])
        if self.include_usage:  # OpenAI: every chunk has the key, null until the last
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope(self.chunk_object, []), "usage": _usage(usage)}

    def response(self, tokens: list[Token], finished: Finished) -> dict:
        body = self._envelope(self.object, [self.choice(tokens, finished)])
        return {**body, "usage": _usage(finished.usage)}

    def _envelope(self, object_: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_, "created": self.created,
                "model": self.model_id, "system_fingerprint": None, "choices": choices}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)


class ChatFormat(ResponseFormat):
    prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self) -> list[dict]:
        return [self.chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})]

    def token_chunk(self, tokens: list[Token]) -> dict:
        text = "".join(t.text for t in tokens)
        return self.chunk({"index": 0, "delta": {"content": text},
                           "logprobs": self._logprobs(tokens), "finish_reason": None})

    def end_chunk(self, finish_reason: str) -> dict:
        return self.chunk({"index": 0, "delta": {}, "logprobs": None,
                           "finish_reason": finish_reason})

    def choice(self, tokens: list[Token], finished: Finished) -> dict:
        return {"index": 0,
                "message": {"role": "assistant", "content": finished.text, "refusal": None},
                "logprobs": self._logprobs(tokens), "finish_reason": finished.finish_reason}

    def _logprobs(self, tokens: list[Token]) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": [self._entry(t) for t in tokens], "refusal": None}

    def _entry(self, token: Token) -> dict:
        top = [self._alternative(i, lp) for i, lp in token.top_logprobs[: self.logprobs]]
        return {**self._alternative(token.token_id, token.logprob), "top_logprobs": top}

    def _alternative(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class CompletionFormat(ResponseFormat):
    prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"  # OpenAI streams legacy completions as the same object

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._offset = 0  # characters of reply text before the next token (text_offset)

    def token_chunk(self, tokens: list[Token]) -> dict:
        return self.chunk({"index": 0, "text": "".join(t.text for t in tokens),
                           "logprobs": self._logprobs(tokens), "finish_reason": None})

    def end_chunk(self, finish_reason: str) -> dict:
        return self.chunk({"index": 0, "text": "", "logprobs": None,
                           "finish_reason": finish_reason})

    def choice(self, tokens: list[Token], finished: Finished) -> dict:
        return {"index": 0, "text": finished.text, "logprobs": self._logprobs(tokens),
                "finish_reason": finished.finish_reason}

    def _logprobs(self, tokens: list[Token]) -> dict | None:
        if self.logprobs is None:
            return None
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token.text)
        return {
            "tokens": [self.token_text(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{self.token_text(i): lp for i, lp in t.top_logprobs[: self.logprobs]}
                             for t in tokens],
            "text_offset": offsets,
        }


def _usage(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


# ---- validation errors -------------------------------------------------------------------


def validation_error(errors: Sequence[dict]) -> ApiError:
    """Pydantic's most specific complaint as one OpenAI-style 400. A value that fits no
    member of a union gets one complaint per member; the deepest one says the most."""
    if not errors:
        return ApiError(400, "The request body is invalid.")
    error = max(errors, key=lambda e: len(e.get("loc", ())))
    if error.get("type") == "json_invalid":
        return ApiError(400, "The request body is not valid JSON.")
    param = _param_path(error.get("loc", ()))
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if not param:
        return ApiError(400, f"The request body must be a JSON object: {message}")
    return ApiError(400, f"Invalid value for '{param}': {message}", param=param)


def _param_path(loc: Sequence) -> str:
    """('body', 'messages', 0, 'list[ContentPart]', 0, 'type') -> 'messages[0].content[0].type':
    the body prefix and pydantic's union-member tags dropped."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" not in part and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})
