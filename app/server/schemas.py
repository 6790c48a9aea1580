"""The OpenAI wire format: request bodies (and the one place they become engine input),
response objects, and validation errors in OpenAI's shape.

Validation is strict, as OpenAI's is: a boolean must be a JSON boolean, a number a number,
ranges follow OpenAI's API reference, and rules that span fields (`top_logprobs` needs
`logprobs`, `stream_options` needs `stream`, content where OpenAI requires it) are checked
by `check()` -- a bad value is a 400 before anything runs. Every parameter OpenAI defines is
either honoured, harmless to ignore (`user`, `metadata`, `store`, `service_tier`, ...), or
refused with a 400 naming it (`n` > 1, `echo`, audio, web search, ...): nothing that would
change the answer is silently dropped. Sampling defaults are OpenAI's (temperature 1, top_p 1,
no top-k), not the app's, so a client gets what it expects from the API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.chat.budget import plan_reply
from app.engine.events import Finished, Token, Usage
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message
from app.models.reasoning import ReasoningSplitter, split_reasoning

DEFAULT_MAX_TOKENS = 4096  # reply budget when the request names none (capped by the context)

# Unknown keys are ignored (clients add their own); known ones are strict: no "yes" for true,
# no "5" for 5. Floats refuse NaN and infinities (Python's JSON reader accepts `NaN`).
_STRICT = ConfigDict(extra="ignore", strict=True)


def _number(**bounds) -> Any:
    return Field(None, allow_inf_nan=False, **bounds)


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


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' is not supported by this server: {why}", param=param,
                    code="unsupported_parameter")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False


class SamplingFields(BaseModel):
    """What chat and text completions share."""

    model_config = _STRICT
    model: str | None = None  # None: the one model served; another name is a 404
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = _number(ge=0, le=2)
    top_p: float | None = _number(gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = _number(ge=-2, le=2)
    frequency_penalty: float | None = _number(ge=-2, le=2)
    # Token id (as a string: JSON keys are strings) -> bias in [-100, 100]; ids are checked
    # against the vocabulary in `check`.
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, unused
    # Not OpenAI's, but common among local servers.
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = _number(ge=0, le=1)
    repetition_penalty: float | None = _number(gt=0, le=10)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported: this server returns one choice per request")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > 16:
            raise ValueError("at most 16 stop sequences")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, bias: dict[str, float] | None):
        for key, value in (bias or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be between -100 and 100, got {value} for {key}")
        return bias

    def check(self, model_id: str, vocab_size: int) -> None:
        """The rules that span fields or need the model; raises ApiError."""
        if self.model is not None and self.model != model_id:
            raise ApiError(404, f"The model `{self.model}` does not exist. Available models: "
                                f"{model_id}.", param="model", code="model_not_found")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' "
                                "is enabled.", param="stream_options")
        for key in self.logit_bias or {}:
            if int(key) >= vocab_size:
                raise ApiError(400, f"Invalid value for 'logit_bias': token id {int(key)} is "
                                    f"outside the vocabulary (0..{vocab_size - 1}).",
                               param="logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def sampling(self, max_tokens: int, top_logprobs: int, logits_processors=()) -> SamplingParams:
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
            logits_processors=tuple(logits_processors),
        )


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported; only 'text'")
        return kind


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def check(self, where: str) -> None:
        """OpenAI's rules: content is required except on an assistant turn that calls tools;
        a tool result names the call it answers."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            need = ("content, or tool_calls" if self.role == "assistant" else "content")
            raise ApiError(400, f"Invalid value for '{where}.content': a message with role "
                                f"'{self.role}' must have {need}.", param=f"{where}.content")
        if self.role == "tool" and not self.tool_call_id:
            raise ApiError(400, f"Missing required parameter: '{where}.tool_call_id'.",
                           param=f"{where}.tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise ApiError(400, f"Invalid parameter: '{where}.tool_calls' is only allowed on "
                                "assistant messages.", param=f"{where}.tool_calls")

    def to_message(self) -> Message:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        calls = ([c.model_dump() for c in self.tool_calls] if self.tool_calls else None)
        if role == "assistant" and calls is None:
            content = content or ""
        return Message(role, content, tool_calls=calls, tool_call_id=self.tool_call_id,
                       name=self.name)


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatParam(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: dict[str, str]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormatParam | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's and SGLang's extensions for carrying on a reply: the last message, an assistant
    # one, is continued (no end of turn, no new turn); Ferrox Chat's Continue on a remote
    # model sends them.
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    # Accepted and unused: they do not change the reply.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefixes are cached whatever the key
    safety_identifier: str | None = None
    # Refused when they would ask for something this server cannot do.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    def check(self, model_id: str, vocab_size: int) -> None:
        super().check(model_id, vocab_size)
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")
        if self.continue_final_message:
            if self.add_generation_prompt:  # vLLM's rule and wording
                raise ApiError(400, "Cannot set both `continue_final_message` and "
                                    "`add_generation_prompt` to True.",
                               param="continue_final_message")
            if self.messages[-1].role != "assistant":
                raise ApiError(400, "'continue_final_message' needs the last message to be an "
                                    "assistant message.", param="continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "Invalid value for 'top_logprobs': 'logprobs' must be set to "
                                "true when 'top_logprobs' is given.", param="top_logprobs")
        if self.modalities is not None and self.modalities != ["text"]:
            raise _refuse("modalities", "it answers with text only")
        refused = {"audio": "it answers with text only",
                   "functions": "use 'tools' instead",
                   "function_call": "use 'tool_choice' instead",
                   "web_search_options": "it has no web search",
                   "prediction": "predicted outputs are not implemented",
                   "reasoning_effort": "the model's reasoning cannot be tuned here",
                   "verbosity": "the reply's length is set by max_tokens only"}
        for name, why in refused.items():
            if getattr(self, name) is not None:
                raise _refuse(name, why)
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise ApiError(400, "Missing required parameter: 'response_format.json_schema'.",
                           param="response_format.json_schema")

    @property
    def wants_json(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

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
    suffix: str | None = None
    # Chat parameters some clients send here too: refused rather than silently dropped.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None

    def check(self, model_id: str, vocab_size: int) -> None:
        super().check(model_id, vocab_size)
        for name in ("response_format", "tools"):
            if getattr(self, name) is not None:
                raise _refuse(name, "it is a chat completions parameter; use "
                                    "/v1/chat/completions")

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
    DEFAULT_MAX_TOKENS), decided by the one context budget (app/chat/budget.plan_reply; an
    explicit max_tokens is never lowered). A prompt plus reply that cannot fit the context is
    a 400 here, before anything is queued, rather than a failure mid-stream. The message is
    vLLM's, word for word: client libraries (litellm's ContextWindowExceededError) recognise
    it."""
    plan = plan_reply(context, prompt_tokens, requested, clamp=False, default=DEFAULT_MAX_TOKENS)
    if not plan.fits:
        reply = 1 if requested is None else requested
        raise ApiError(400, f"This model's maximum context length is {context} tokens. "
                            f"However, you requested {plan.prompt_tokens + reply} tokens "
                            f"({plan.prompt_tokens} in the messages, {reply} in the completion). "
                            "Please reduce the length of the messages or completion.",
                       param=prompt_param if requested is None or plan.room < 1 else "max_tokens",
                       code="context_length_exceeded")
    return plan.max_tokens


def _given(value, default):
    return default if value is None else value


# ---- responses ---------------------------------------------------------------------------


class ResponseFormat:
    """How one endpoint shapes its objects (OpenAI's `chat.completion`, `text_completion`
    and their stream chunks); one instance per request, for its id and offsets."""

    prefix = ""
    object = ""
    chunk_object = ""
    reads_tokens = False  # True: every token goes to token_chunk, text or not

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

    def end_chunks(self, finish_reason: str) -> list[dict]:
        """What a stream sends when the reply ends (before usage and [DONE])."""
        return [self.end_chunk(finish_reason)]

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
    """A chat answer. A reasoning model's thinking (`<think>…</think>`, or everything before
    `</think>` when the prompt opened the tag) goes out as `reasoning_content`, apart from
    `content`, as vLLM and DeepSeek's API send it; a reply without thinking has no such key."""

    prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model_id: str, tokenizer, logprobs: int | None, include_usage: bool,
                 *, starts_in_reasoning: bool = False):
        super().__init__(model_id, tokenizer, logprobs, include_usage)
        self._starts_in_reasoning = starts_in_reasoning
        self._splitter = ReasoningSplitter(starts_in_reasoning=starts_in_reasoning)

    def opening(self) -> list[dict]:
        return [self.chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})]

    def token_chunk(self, tokens: list[Token]) -> dict | None:
        thinking, answer = self._splitter.push("".join(t.text for t in tokens))
        return self._text_chunk(thinking, answer, self._logprobs(tokens))

    def _text_chunk(self, thinking: str, answer: str, logprobs: dict | None) -> dict | None:
        if not thinking and not answer and logprobs is None:
            return None  # held back (a tag may be forming): nothing to say yet
        delta = {"reasoning_content": thinking} if thinking else {}
        if answer or not thinking:
            delta["content"] = answer
        return self.chunk({"index": 0, "delta": delta, "logprobs": logprobs,
                           "finish_reason": None})

    def end_chunks(self, finish_reason: str) -> list[dict]:
        rest = self._text_chunk(*self._splitter.flush(), None)
        return ([rest] if rest is not None else []) + [self.end_chunk(finish_reason)]

    def end_chunk(self, finish_reason: str) -> dict:
        return self.chunk({"index": 0, "delta": {}, "logprobs": None,
                           "finish_reason": finish_reason})

    def choice(self, tokens: list[Token], finished: Finished) -> dict:
        reasoning, answer = split_reasoning(finished.text,
                                            starts_in_reasoning=self._starts_in_reasoning)
        message = {"role": "assistant", "content": answer, "refusal": None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return {"index": 0, "message": message, "logprobs": self._logprobs(tokens),
                "finish_reason": finished.finish_reason}

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


class ToolChatFormat(ChatFormat):
    """A chat answer with tools on: calls in the reply become `tool_calls` (streamed as one
    delta per call once the reply ends) and finish_reason "tool_calls"."""

    reads_tokens = True  # a control token ([TOOL_CALLS]) has no text but starts a call

    def __init__(self, model_id: str, tokenizer, logprobs: int | None, include_usage: bool,
                 syntax, known: set[str], stop_ids: set[int], parallel: bool):
        super().__init__(model_id, tokenizer, logprobs, include_usage)
        from app.server.tools import ToolCallReader

        self._syntax, self._known, self._stop_ids = syntax, known, stop_ids
        self._parallel = parallel
        self._reader = ToolCallReader(tokenizer, syntax, known, stop_ids, parallel)

    def token_chunk(self, tokens: list[Token]) -> dict | None:
        text = "".join(self._reader.push(t.token_id) for t in tokens)
        if not text and self.logprobs is None:
            return None
        return self.chunk({"index": 0, "delta": {"content": text},
                           "logprobs": self._logprobs(tokens), "finish_reason": None})

    def end_chunks(self, finish_reason: str) -> list[dict]:
        rest, calls = self._reader.finish()
        chunks = []
        if rest:
            chunks.append(self.chunk({"index": 0, "delta": {"content": rest}, "logprobs": None,
                                      "finish_reason": None}))
        if calls:
            chunks.append(self.chunk({"index": 0, "delta": {
                "tool_calls": [c.wire(i) for i, c in enumerate(calls)]},
                "logprobs": None, "finish_reason": None}))
            finish_reason = "tool_calls"
        return chunks + [self.end_chunk(finish_reason)]

    def choice(self, tokens: list[Token], finished: Finished) -> dict:
        from app.server.tools import parse_reply

        found = parse_reply(self.tokenizer, self._syntax, finished.completion_ids, self._known,
                            self._stop_ids, self._parallel)
        if found is None:
            return super().choice(tokens, finished)
        content, calls = found
        return {"index": 0,
                "message": {"role": "assistant", "content": content or None, "refusal": None,
                            "tool_calls": [c.wire() for c in calls]},
                "logprobs": self._logprobs(tokens), "finish_reason": "tool_calls"}


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
