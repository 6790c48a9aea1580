"""The OpenAI-compatible HTTP API over one loaded model and its `EngineRunner`.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, streaming (SSE)
or not, shaped like OpenAI's objects so the official clients work unchanged, and GET /health.
Every request is one engine request; several in flight share the engine, which batches them.
Before any of it, `guards.RequestGuard` checks the Host header and bounds the body; CORS is
off unless origins are given.

Errors reach the client as OpenAI-shaped bodies with a one-line message; a traceback stays
in the server's log, never on the wire.

Threads: the engine's events arrive on the engine thread and are handed to the event loop
with `call_soon_threadsafe`; nothing here touches engine state. A generation is aborted
whenever its response ends early -- the client went away, or the server is stopping.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.engine.events import Event, Failed, Finished, Token
from app.engine.logits_processors import logit_bias
from app.engine.runner import EngineRunner
from app.engine.sampling import SamplingParams
from app.models.chat_template import ChatPrompt, chat_prompt
from app.models.loader import LoadedModel
from app.server.fim import fim_prompt
from app.server.grammar import GrammarError, GrammarFactory
from app.server.guards import DEFAULT_MAX_BODY_BYTES, RequestGuard, allowed_hosts_for
from app.server.schemas import (ApiError, ChatCompletionRequest, ChatFormat,
                                CompletionFormat, CompletionRequest, NamedToolChoice,
                                ResponseFormat, SamplingFields, ToolChatFormat, reply_budget,
                                validation_error)
from app.server.tools import ToolSyntax, call_schema, marker_token_ids, syntax_for

DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is there

log = logging.getLogger("ferrox.server")


def api_model_id(loaded: LoadedModel) -> str:
    """The name clients use for a served model: its file's (or folder's) name."""
    return loaded.path.stem


def create_app(runner: EngineRunner, loaded: LoadedModel, model_id: str, *,
               bind_host: str = "127.0.0.1", cors_origins: Sequence[str] = (),
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               stopped_why: str = "The server is shutting down") -> FastAPI:
    """The API app. The caller owns `runner`; at shutdown call `abort_open_requests(app)`
    before waiting for connections to close, so open streams end at once. `bind_host`: the
    address listened on, which decides the Host names answered (see guards);
    `cors_origins`: browser origins allowed to call the API (none by default);
    `stopped_why`: what a reply the engine aborted is told (the engine stops only with the
    server here; inside the app, also when the person switches models)."""
    app = FastAPI(title="Ferrox Chat API", docs_url=None, redoc_url=None, openapi_url=None)
    gateway = _Gateway(runner, stopped_why)
    app.state.gateway = gateway
    _install_error_handlers(app)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    # Added last, so it runs first: nothing else sees a request with a foreign Host.
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts_for(bind_host),
                       max_body_bytes=max_body_bytes)
    grammars = _Grammars(loaded)
    created = int(time.time())
    # max_model_len: the context it runs with, in vLLM's field, which clients (this app's
    # remote connections among them) read to size their prompts.
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "ferrox-chat",
            "max_model_len": loaded.context_length}
    tokenizer = loaded.tokenizer

    @app.get("/health")
    async def health() -> JSONResponse:
        if gateway.closing:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok", "model": model_id})

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        if name != model_id:
            raise ApiError(404, f"The model {name!r} does not exist; this server runs "
                                f"{model_id!r}.", param="model", code="model_not_found")
        return card

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check(model_id, tokenizer.vocab_size)
        tools = _tool_plan(loaded, body)
        processors = [await _output_format(grammars, body)] if body.wants_json else []
        if tools is not None and tools.forced is not None:
            processors.append(await _forced_call(grammars, tools.forced))
        messages = [m.to_message() for m in body.messages]
        rendered_tools = tools.definitions if tools is not None else None
        try:  # off the event loop: a long conversation takes a while to tokenize
            prompt = await asyncio.to_thread(_chat_prompt, loaded, messages, rendered_tools,
                                             bool(body.continue_final_message),
                                             body.add_generation_prompt is not False)
        except ValueError as exc:  # e.g. a model's template refusing the order of roles
            raise ApiError(400, f"The conversation cannot be formatted for this model: {exc}",
                           param="messages") from None
        prompt_ids = prompt.ids
        if tools is None:
            answer = ChatFormat(model_id, tokenizer, body.logprobs_count, body.include_usage,
                                starts_in_reasoning=prompt.starts_in_reasoning)
        else:
            answer = ToolChatFormat(model_id, tokenizer, body.logprobs_count,
                                    body.include_usage, tools.syntax, tools.names,
                                    set(loaded.stop_token_ids), tools.parallel)
        return await _respond(gateway, loaded, body, prompt_ids, "messages", answer, request,
                              processors)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check(model_id, tokenizer.vocab_size)
        if body.suffix:
            prompt_ids = await asyncio.to_thread(_fill_in_the_middle, loaded, body)
        else:
            prompt_ids = await asyncio.to_thread(_prompt_ids, loaded, body.prompt)
        answer = CompletionFormat(model_id, tokenizer, body.logprobs_count, body.include_usage)
        return await _respond(gateway, loaded, body, prompt_ids, "prompt", answer, request)

    return app


def _chat_prompt(loaded: LoadedModel, messages: list, tools, continue_final: bool,
                 generation_prompt: bool) -> ChatPrompt:
    """The chat's prompt. `continue_final` (vLLM's `continue_final_message`): the last,
    assistant, message is carried on -- the conversation before it with the assistant's
    header, then its text with no end of turn, as the window's Continue does locally
    (app.engine.session.continuation_prompt), so the model continues the same reply."""
    if not continue_final:
        return chat_prompt(loaded.tokenizer, loaded.template, messages, generation_prompt,
                           tools=tools)
    head = chat_prompt(loaded.tokenizer, loaded.template, messages[:-1], tools=tools)
    partial = messages[-1].content or ""
    return ChatPrompt(head.text + partial,
                      head.ids + loaded.tokenizer.encode(partial, special=True),
                      head.starts_in_reasoning and "</think>" not in partial)


def abort_open_requests(app: FastAPI) -> None:
    """Refuse new requests and abort every generation in flight (the server is stopping)."""
    app.state.gateway.close()


# ---- one request, start to end ---------------------------------------------------------


async def _respond(gateway: "_Gateway", loaded: LoadedModel, body: SamplingFields,
                   prompt_ids: list[int], prompt_param: str, answer: ResponseFormat,
                   request: Request, processors: Sequence = ()):
    max_tokens = reply_budget(body.requested_max_tokens, len(prompt_ids),
                              loaded.context_length, prompt_param)
    # The engine reports the chosen token's logprob only alongside alternatives.
    engine_top = 0 if answer.logprobs is None else max(1, answer.logprobs)
    processors = list(processors) + ([logit_bias(body.bias)] if body.logit_bias else [])
    try:
        params = body.sampling(max_tokens, engine_top, processors)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=str(exc).split()[0]) from None
    generation = await gateway.start(prompt_ids, params)
    if body.stream:
        return _EventStream(_stream(generation, answer), on_close=generation.close)
    try:
        tokens, finished = await _collect(generation, request)
    finally:
        generation.close()
    return JSONResponse(answer.response(tokens, finished))


@dataclass(frozen=True)
class _ToolPlan:
    definitions: list[dict]  # what the template receives
    names: set[str]
    syntax: ToolSyntax
    parallel: bool
    forced: str | None  # the Lark grammar a required / named tool_choice decodes under


def _tool_plan(loaded: LoadedModel, body: ChatCompletionRequest) -> _ToolPlan | None:
    """What `tools` / `tool_choice` ask for on this model; None when tools are off."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice not in ("none", "auto"):
            raise ApiError(400, "Invalid value for 'tool_choice': 'tool_choice' is only allowed "
                                "when 'tools' are specified.", param="tool_choice")
        return None
    if choice == "none":
        return None
    if not loaded.template.supports_tools:
        raise ApiError(400, "This model's chat template has no tool support, so 'tools' "
                            "cannot be used with it.", param="tools",
                       code="unsupported_parameter")
    definitions = [t.model_dump(exclude_none=True) for t in body.tools]
    names = {t.function.name for t in body.tools}
    named = choice.function.get("name") if isinstance(choice, NamedToolChoice) else None
    if isinstance(choice, NamedToolChoice) and named not in names:
        raise ApiError(400, f"Invalid value for 'tool_choice': no tool named {named!r} is in "
                            "'tools'.", param="tool_choice")
    parallel = body.parallel_tool_calls is not False
    syntax = syntax_for(loaded.template, loaded.tokenizer)
    forced = None
    if choice == "required" or named is not None:
        if body.wants_json:
            raise ApiError(400, "'response_format' cannot be combined with a required tool "
                                "call.", param="response_format")
        schema = call_schema(definitions, named, syntax)
        forced = syntax.lark(schema, parallel and named is None,
                             marker_token_ids(loaded.tokenizer, syntax))
    return _ToolPlan(definitions, names, syntax, parallel, forced)


async def _forced_call(grammars: "_Grammars", grammar: str):
    factory = await grammars.get()
    try:
        return await asyncio.to_thread(factory.lark, grammar)
    except GrammarError as exc:
        raise ApiError(400, f"Invalid value for 'tools': a function's parameters cannot be "
                            f"enforced: {exc}", param="tools") from None


async def _output_format(grammars: "_Grammars", body: ChatCompletionRequest):
    """response_format json_object / json_schema as a constraint on decoding (a processor
    factory), so the reply always parses and matches the schema (unless cut by max_tokens)."""
    fmt = body.response_format
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
    if fmt.type == "json_schema" and schema is None:
        schema = {"type": "object"}  # OpenAI's schema is optional: any JSON object
    factory = await grammars.get()
    try:
        return await asyncio.to_thread(factory.json_schema, schema)
    except GrammarError as exc:
        raise ApiError(400, f"Invalid value for 'response_format': {exc}",
                       param="response_format.json_schema.schema") from None


class _Grammars:
    """The model's grammar factory, built on first use (about a second for a 262k-token
    vocabulary) off the event loop, then shared by every request."""

    def __init__(self, loaded: LoadedModel):
        self._loaded = loaded
        self._factory = None
        self._lock = asyncio.Lock()

    async def get(self):
        async with self._lock:
            if self._factory is None:
                loaded = self._loaded
                try:
                    self._factory = await asyncio.to_thread(
                        GrammarFactory, loaded.tokenizer, loaded.vocab_size,
                        set(loaded.stop_token_ids))
                except ImportError:
                    raise ApiError(400, "Structured output needs the 'llguidance' package, "
                                        "which is not installed.", param="response_format",
                                   code="unsupported_parameter") from None
                except GrammarError as exc:
                    raise ApiError(400, f"Structured output is not available for this model: "
                                        f"{exc}", param="response_format") from None
            return self._factory


def _fill_in_the_middle(loaded: LoadedModel, body: CompletionRequest) -> list[int]:
    if not isinstance(body.prompt, str):
        raise ApiError(400, "'suffix' needs a text prompt, not token ids.", param="suffix")
    ids = fim_prompt(loaded.tokenizer, body.prompt, body.suffix)
    if ids is None:
        raise ApiError(400, "'suffix' (fill-in-the-middle) is not supported by this model: its "
                            "vocabulary has no FIM tokens.", param="suffix",
                       code="unsupported_parameter")
    return ids


def _prompt_ids(loaded: LoadedModel, prompt: str | list[int]) -> list[int]:
    tokenizer = loaded.tokenizer
    if isinstance(prompt, str):
        # Control-token strings in the text become their tokens, as in other local servers,
        # so a hand-formatted chat prompt works.
        bos = [tokenizer.bos_id] if tokenizer.add_bos else []
        return bos + tokenizer.encode(prompt, special=True)
    vocab = tokenizer.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"The prompt holds token id {bad}, outside the vocabulary "
                            f"(0..{vocab - 1}).", param="prompt")
    return list(prompt)


async def _stream(generation: "_Generation", answer: ResponseFormat) -> AsyncIterator[str]:
    """Server-sent events: the answer's chunks, then `[DONE]`; an error event if the engine
    fails or the server stops mid-reply."""
    for chunk in answer.opening():
        yield _sse(chunk)
    while True:
        event = await generation.next()
        if isinstance(event, Token):
            if event.text or answer.logprobs is not None or answer.reads_tokens:
                chunk = answer.token_chunk([event])
                if chunk is not None:
                    yield _sse(chunk)
        elif isinstance(event, Finished):
            if event.finish_reason == "abort":
                yield _sse(_stopped(generation).body())
                return
            for chunk in answer.end_chunks(event.finish_reason):
                yield _sse(chunk)
            if answer.include_usage:
                yield _sse(answer.usage_chunk(event.usage))
            yield "data: [DONE]\n\n"
            return
        elif isinstance(event, Failed):
            yield _sse(_engine_failure(event).body())
            return


async def _collect(generation: "_Generation", request: Request) -> tuple[list[Token], Finished]:
    """A whole reply. Every DISCONNECT_POLL_S, tokens flowing or not, it checks that the
    client is still there: nobody would read the answer, so the caller aborts it."""
    tokens: list[Token] = []
    check_at = time.monotonic() + DISCONNECT_POLL_S
    while True:
        try:
            event = await asyncio.wait_for(generation.next(), DISCONNECT_POLL_S)
        except TimeoutError:
            event = None
        if time.monotonic() >= check_at:
            if await request.is_disconnected():
                raise ApiError(499, "The client closed the connection.")
            check_at = time.monotonic() + DISCONNECT_POLL_S
        if isinstance(event, Token):
            tokens.append(event)
        elif isinstance(event, Finished):
            if event.finish_reason == "abort":
                raise _stopped(generation)
            return tokens, event
        elif isinstance(event, Failed):
            raise _engine_failure(event)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _engine_failure(event: Failed) -> ApiError:
    return ApiError(500, _one_line(event.message), code="engine_error", kind="server_error")


def _one_line(message: str) -> str:
    """An engine message for the wire: its first line. An internal error's traceback goes to
    the server's log instead."""
    first, _, rest = message.partition("\n")
    if rest:
        log.error("%s", message)
    return first.rstrip(":") + (" (details are in the server's log)" if rest else "")


def _stopped(generation: "_Generation") -> ApiError:
    """A reply the engine aborted: the server is stopping (or the engine serving it is)."""
    return ApiError(503, f"{generation.stopped_why}; the reply was stopped.",
                    code="server_shutting_down", kind="server_error")


class _EventStream(StreamingResponse):
    """An SSE response that closes its generation however the response ends: finished,
    client gone (Starlette cancels the stream on disconnect), or server stopping."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ---- the bridge from the engine thread ------------------------------------------------


class _Generation:
    """One request in the engine. Its events cross from the engine thread into the event
    loop through `call_soon_threadsafe`; `next` awaits them in order."""

    def __init__(self, runner: EngineRunner, prompt_ids: Sequence[int], params: SamplingParams,
                 on_close: Callable[["_Generation"], None], stopped_why: str):
        self._runner = runner
        self.stopped_why = stopped_why
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._on_close = on_close
        self.finished = False  # Finished or Failed has been read
        self.id = runner.submit(prompt_ids, params, self._hand_over)

    def _hand_over(self, event: Event) -> None:  # on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    async def next(self) -> Event:
        event = await self._events.get()
        if isinstance(event, (Finished, Failed)):
            self.finished = True
        return event

    def abort(self) -> None:
        if not self.finished:
            self._runner.abort(self.id)

    def close(self) -> None:
        """The response is over: abort if the engine is still at it, and forget it."""
        self.abort()
        self._on_close(self)


class _Gateway:
    """The server's door to the runner: starts generations, keeps the open ones so a
    shutdown can abort them, and refuses new work once closing. Event-loop thread only."""

    def __init__(self, runner: EngineRunner, stopped_why: str):
        self.runner = runner
        self.stopped_why = stopped_why
        self._open: set[_Generation] = set()
        self._closing = False

    async def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> _Generation:
        """Submit and wait for the engine to accept it: a refusal (too long for the KV
        memory, a bad token id) is the client's error, a 400, before any response starts."""
        if self._closing:
            raise ApiError(503, "The server is shutting down.", code="server_shutting_down",
                           kind="server_error")
        generation = _Generation(self.runner, prompt_ids, params, self._open.discard,
                                 self.stopped_why)
        self._open.add(generation)
        try:
            first = await generation.next()  # Queued, or Failed when refused
        except BaseException:
            generation.close()
            raise
        if isinstance(first, Failed):
            generation.close()
            raise ApiError(400, _one_line(first.message), code="request_refused")
        return generation

    @property
    def closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True
        for generation in list(self._open):
            generation.abort()


# ---- errors in OpenAI's shape ----------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = ApiError(exc.status_code, str(exc.detail), kind=kind)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("Internal error on %s", request.url.path, exc_info=exc)
        error = ApiError(500, f"Internal server error ({type(exc).__name__}); details are in "
                              "the server's log.", kind="server_error")
        return JSONResponse(error.body(), status_code=500)
