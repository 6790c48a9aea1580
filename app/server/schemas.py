"""Request bodies of the OpenAI-compatible API, and the one place they become engine input.

Field ranges follow OpenAI's API reference, so a bad value is a 400 before anything runs.
Fields we have no use for (`user`, `metadata`, `tools`, ...) are accepted and ignored, as
clients send them routinely; what would silently change the answer and cannot be honoured
(`n` > 1, `best_of` > 1, `echo`) is refused. Sampling defaults are OpenAI's (temperature 1,
top_p 1, no top-k), not the app's, so a client gets what it expects from the API.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.engine.sampling import SamplingParams
from app.models.chat_template import Message

DEFAULT_MAX_TOKENS = 4096  # reply budget when the request names none (capped by the context)


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
