"""An OpenAI-compatible server (vLLM, SGLang, llama.cpp server, Ollama, ...) behind the
backend seam.

Threads: each reply streams on its own daemon thread, so neither the GUI thread nor another
reply ever waits for the network; the one `httpx.Client` (a thread-safe connection pool) is
shared. Every failure -- refused, unknown host, TLS, HTTP error, timeout, a stream cut short --
ends the reply with one `Failed` event; nothing is raised into the caller's thread.

Prefix caching on the server: the request body is the messages exactly as given, serialized
with a fixed key order and no whitespace, so a chat's turn N+1 starts with the same bytes as
turn N and the server's prefix cache (vLLM, SGLang radix cache, llama.cpp slots) hits; and a
chat sends the same session header (`X-Session-ID` unless the connection names another) on
every turn, so a prefix-aware router (SGLang router, vLLM production-stack) keeps it on one
worker.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from app.backends.base import BackendError, BackendModel, Listener
from app.backends.base_url import normalize_base_url, server_root
from app.backends.openai_stream import (DONE, ReplyAssembly, StreamError, cached_tokens,
                                        completion_tokens, prompt_tokens, sse_payloads)
from app.backends.remote_errors import (RemoteFailure, describe_exception, describe_status,
                                        error_detail, where)
from app.engine.events import Event, Failed, Finished, Timings, Token, Usage

log = logging.getLogger(__name__)

DEFAULT_SESSION_HEADER = "X-Session-ID"
CHARS_PER_TOKEN = 4  # the usual estimate for English text with BPE vocabularies
MAX_ERROR_BODY = 64 * 1024  # bytes of an error answer read for its message
TOKENIZE_TIMEOUT_S = 3.0
COUNT_CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class RemoteSettings:
    """One connection's settings. `context_sizes` (model name -> tokens) are the person's own
    figures; they win over what the server says."""

    base_url: str
    api_key: str | None = field(default=None, repr=False)
    session_header: str = DEFAULT_SESSION_HEADER
    context_sizes: Mapping[str, int] = field(default_factory=dict)
    timeout_s: float = 300.0  # the longest silence while waiting for a reply's next bytes
    connect_timeout_s: float = 10.0
    # The longest wait for a small answer (the model list, /props): a server that
    # accepts connections but does not answer them (still loading, or hung) is reported in
    # seconds instead of leaving "Asking the server…" up for five minutes.
    query_timeout_s: float = 20.0
    # top_k, min_p and repetition_penalty are not OpenAI parameters; vLLM, SGLang, llama.cpp
    # and Ollama take them, OpenAI itself refuses them. Off: only standard ones are sent.
    extended_sampling: bool = True
    name: str = ""  # the connection's name, for the status bar

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))

    def __repr__(self) -> str:  # the key never appears, even in a traceback's locals
        key = "set" if self.api_key else "none"
        return (f"RemoteSettings(base_url={self.base_url!r}, api_key=<{key}>, "
                f"session_header={self.session_header!r}, name={self.name!r})")


@dataclass(frozen=True)
class RemoteModel:
    name: str
    context_length: int | None  # None: the server does not say


def estimate_tokens(text: str) -> int:
    return max(1, -(-len(text) // CHARS_PER_TOKEN)) if text else 0


def message_json(message) -> dict:
    """One message in the OpenAI shape, keys always in the same order. A mapping is passed
    through as it is (its own key order kept)."""
    if isinstance(message, Mapping):
        return dict(message)
    body = {"role": message.role, "content": message.content}
    for key in ("name", "tool_calls", "tool_call_id"):
        value = getattr(message, key, None)
        if value is not None:
            body[key] = list(value) if key == "tool_calls" else value
    return body


def chat_request_body(model: str, messages: Sequence, params, extended_sampling: bool = True,
                      partial: str = "") -> bytes:
    """The exact bytes POSTed to /chat/completions (see the module docstring on caching).

    `partial` (Continue): the reply so far goes last, as an assistant message, with vLLM's
    `continue_final_message: true, add_generation_prompt: false`: the server renders the
    conversation without closing that turn and the model carries it on. vLLM and SGLang
    take these keys, and so does Ferrox Chat's own `serve`; llama.cpp server and Ollama carry
    on a final assistant message by themselves (they ignore the keys). A server that knows
    neither (OpenAI's own API) refuses the request, and the reply stays as it was."""
    wire = [message_json(m) for m in messages]
    if partial:
        wire.append({"role": "assistant", "content": partial})
    body: dict = {"model": model, "messages": wire,
                  "stream": True, "stream_options": {"include_usage": True},
                  "max_tokens": params.max_tokens, "temperature": params.temperature,
                  "top_p": params.top_p}
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if extended_sampling:
        if params.top_k:
            body["top_k"] = params.top_k
        if params.min_p:
            body["min_p"] = params.min_p
        if params.repetition_penalty != 1.0:
            body["repetition_penalty"] = params.repetition_penalty
    if partial:
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class _Request:
    """One reply in flight: its abort flag and, once answered, its response."""

    def __init__(self, request_id: str):
        self.id = request_id
        self.aborted = threading.Event()
        self.response: httpx.Response | None = None


class RemoteBackend:
    kind = "remote"

    def __init__(self, settings: RemoteSettings):
        self.settings = settings
        self._client = httpx.Client(
            timeout=httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s),
            headers=({"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}),
            follow_redirects=True)
        self._model: BackendModel | None = None
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._tokenize_works: bool | None = None  # None: not tried yet
        self._tokenize_url: str | None = None  # where the server counted, once it has
        # The server's counts, per model and text (a chat's messages are counted again every
        # turn, a document once per chat): digest -> tokens, oldest first.
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def __repr__(self) -> str:
        return f"RemoteBackend({self.settings!r})"

    # -- models ---------------------------------------------------------------------------

    def list_models(self) -> list[RemoteModel]:
        """The server's models with their context sizes where known. Raises BackendError."""
        url = f"{self.settings.base_url}/models"
        data = self._get_json(url)
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list):
            raise BackendError(f"The server at {where(url)} answered /models with something that "
                               "is not a model list; is the base URL an OpenAI-compatible one (…/v1)?")
        props_context = self._llama_cpp_context() if any(_is_llama_cpp(c) for c in cards) else None
        models = []
        for card in cards:
            if isinstance(card, dict) and isinstance(card.get("id"), str):
                name = card["id"]
                server_says = props_context or _card_context(card)
                models.append(RemoteModel(name, self.settings.context_sizes.get(name) or server_says))
        return models

    def describe(self) -> BackendModel | None:
        return self._model

    def load(self, model_ref: str) -> BackendModel:
        """Check the server has `model_ref` and learn its context size (blocking)."""
        models = self.list_models()
        found = next((m for m in models if m.name == model_ref), None)
        if found is None:
            offered = ", ".join(m.name for m in models[:10]) or "none"
            raise BackendError(f"The server at {where(self.settings.base_url)} has no model "
                               f"{model_ref!r}. It offers: {offered}.")
        self._model = BackendModel("remote", found.name, found.context_length, self._location())
        return self._model

    def use_model(self, name: str, context_length: int | None = None) -> BackendModel:
        """Choose `name` without asking the server (it may be down now; a chat remembers its
        model): a wrong name shows on the first reply as a 404."""
        context = self.settings.context_sizes.get(name) or context_length
        self._model = BackendModel("remote", name, context, self._location())
        return self._model

    def _location(self) -> str:
        place = where(self.settings.base_url)
        return f"{self.settings.name} ({place})" if self.settings.name else place

    def _llama_cpp_context(self) -> int | None:
        """llama.cpp's running context size (`/props`), which beats the trained one."""
        try:
            props = self._get_json(f"{server_root(self.settings.base_url)}/props")
        except BackendError:
            return None
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        n_ctx = (settings or {}).get("n_ctx") if isinstance(settings, dict) else None
        return n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None

    def _get_json(self, url: str):
        try:
            response = self._client.get(url, timeout=self._query_timeout())
        except Exception as exc:  # noqa: BLE001 -- every transport failure becomes a message
            waited = self._timeout_for(exc, self.settings.query_timeout_s)
            raise BackendError(describe_exception(exc, url, timeout_s=waited).message) from None
        if response.status_code >= 400:
            failure = describe_status(response.status_code, response.content[:MAX_ERROR_BODY],
                                      response.headers, url, None)
            raise BackendError(failure.message)
        try:
            return response.json()
        except ValueError:
            raise BackendError(f"The server at {where(url)} answered {url} with something that is "
                               "not JSON; is the base URL right?") from None

    def _query_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.settings.query_timeout_s, connect=self.settings.connect_timeout_s)

    def _timeout_for(self, exc: BaseException, read_timeout_s: float | None = None) -> float:
        if isinstance(exc, httpx.ConnectTimeout):
            return self.settings.connect_timeout_s
        return self.settings.timeout_s if read_timeout_s is None else read_timeout_s

    # -- tokens ---------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        """The server's count where it has a /tokenize endpoint (vLLM, SGLang, llama.cpp
        server), else an estimate (about 4 characters a token); a server without one is not
        asked again. Counts are cached per model and text. Blocking for up to a few seconds
        on a miss: call it off the GUI thread, or use `estimate_tokens` for a quick figure."""
        if self._tokenize_works is False or self._model is None or not text:
            return estimate_tokens(text)
        key = hashlib.blake2b(f"{self._model.name}\0{text}".encode("utf-8", "surrogatepass"),
                              digest_size=16).digest()
        with self._lock:
            cached = self._counts.get(key)
            if cached is not None:
                self._counts.move_to_end(key)
                return cached
        counted = self._tokenize(text)
        self._tokenize_works = counted is not None
        if counted is None:
            return estimate_tokens(text)
        with self._lock:
            self._counts[key] = counted
            while len(self._counts) > COUNT_CACHE_ENTRIES:
                self._counts.popitem(last=False)
        return counted

    def busy(self) -> bool:
        """Whether a reply is in flight."""
        with self._lock:
            return bool(self._requests)

    def _tokenize(self, text: str) -> int | None:
        """The server's count, or None. vLLM and llama.cpp server answer at the server's root
        (`/tokenize`), SGLang under the API (`/v1/tokenize`): the first that answers is kept."""
        # One body for all: vLLM and SGLang read model+prompt and answer "count"; llama.cpp
        # reads content and answers "tokens". Each ignores the others' keys.
        body = {"model": self._model.name, "prompt": text, "content": text,
                "add_special": False, "add_special_tokens": False}
        urls = ([self._tokenize_url] if self._tokenize_url else
                [f"{server_root(self.settings.base_url)}/tokenize", f"{self.settings.base_url}/tokenize"])
        for url in urls:
            try:
                response = self._client.post(url, json=body, timeout=TOKENIZE_TIMEOUT_S)
                data = response.json() if response.status_code == 200 else None
            except Exception:  # noqa: BLE001 -- no endpoint, or no answer: estimate instead
                data = None
            count = (data["count"] if isinstance(data, dict) and isinstance(data.get("count"), int)
                     else len(data["tokens"]) if isinstance(data, dict)
                     and isinstance(data.get("tokens"), list) else None)
            if count is not None:
                self._tokenize_url = url
                return count
        return None

    # -- replies --------------------------------------------------------------------------

    def submit_chat(self, messages: Sequence, params, on_event: Listener,
                    request_id: str | None = None, session_id: str | None = None,
                    partial: str = "") -> str:
        request = _Request(request_id or uuid.uuid4().hex)
        with self._lock:
            self._requests[request.id] = request
        model = self._model.name if self._model else None
        thread = threading.Thread(target=self._run, name=f"remote-reply-{request.id[:8]}", daemon=True,
                                  args=(request, model, list(messages), params, on_event, session_id,
                                        partial))
        thread.start()
        return request.id

    def abort(self, request_id: str) -> None:
        with self._lock:
            request = self._requests.get(request_id)
        if request is None:
            return
        request.aborted.set()
        _wake_reader(request.response)

    def close(self) -> None:
        with self._lock:
            requests = list(self._requests.values())
        for request in requests:
            self.abort(request.id)
        self._client.close()

    def _run(self, request: _Request, model: str | None, messages: list, params,
             on_event: Listener, session_id: str | None, partial: str = "") -> None:
        """The reply's thread: one terminal event, whatever happens."""
        reply = _ReplyEvents(request.id, on_event, messages)
        try:
            if model is None:
                reply.fail(RemoteFailure("No remote model is chosen. Pick one in the model picker."))
                return
            self._stream(request, model, messages, params, session_id, reply, partial)
        except BaseException as exc:  # noqa: BLE001 -- a bug must still end the reply
            log.exception("remote reply %s failed unexpectedly", request.id)
            reply.fail(RemoteFailure(f"The reply failed unexpectedly: {type(exc).__name__}: {exc}"))
        finally:
            with self._lock:
                self._requests.pop(request.id, None)

    def _stream(self, request: _Request, model: str, messages: list, params, session_id: str | None,
                reply: _ReplyEvents, partial: str = "") -> None:
        url = f"{self.settings.base_url}/chat/completions"
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if session_id:
            headers[self.settings.session_header] = session_id
        body = chat_request_body(model, messages, params, self.settings.extended_sampling, partial)
        started = False
        try:
            with self._client.stream("POST", url, content=body, headers=headers) as response:
                request.response = response  # set before the abort check: see abort()
                if request.aborted.is_set():
                    reply.finish("abort")
                    return
                if response.status_code >= 400:
                    reply.fail(describe_status(response.status_code, _read_bounded(response),
                                               response.headers, url, model))
                    return
                started = True
                done = self._read_events(request, response, reply)
        except StreamError as exc:
            reply.fail(RemoteFailure(f"The server at {where(url)} reported an error during the "
                                     f"reply: {exc}" + ("; the text so far is kept." if reply.assembly.text else "")))
            return
        except Exception as exc:  # noqa: BLE001 -- transport failures, reported below
            if request.aborted.is_set():
                reply.finish("abort")
                return
            reply.fail(describe_exception(exc, url, timeout_s=self._timeout_for(exc), mid_reply=started))
            return
        if request.aborted.is_set():
            reply.finish("abort")
        elif done or reply.assembly.finish_reason:
            reply.finish(reply.assembly.finish_reason or "stop")
        else:
            reply.fail(describe_exception(httpx.RemoteProtocolError("stream ended early"), url,
                                          timeout_s=self.settings.timeout_s, mid_reply=True))

    def _read_events(self, request: _Request, response: httpx.Response, reply: _ReplyEvents) -> bool:
        """Deliver the stream's text; True when the server said [DONE]."""
        for payload in sse_payloads(response.iter_lines()):
            if request.aborted.is_set():
                return False
            if payload is DONE:
                return True
            reply.add(payload)
        return False


class _ReplyEvents:
    """Turns stream chunks into engine events for one reply, and ends it exactly once."""

    def __init__(self, request_id: str, on_event: Listener, messages: list):
        self.request_id = request_id
        self.on_event = on_event
        self.messages = messages
        self.assembly = ReplyAssembly()
        self.started_at = time.monotonic()
        self.first_text_at: float | None = None
        self.ended = False

    def add(self, payload: object) -> None:
        piece = self.assembly.add(payload)
        if piece:
            if self.first_text_at is None:
                self.first_text_at = time.monotonic()
            self._emit(Token(self.request_id, token_id=None, text=piece))

    def finish(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self._emit(Finished(self.request_id, reason, self.assembly.text, self._usage(), self._timings()))

    def fail(self, failure: RemoteFailure) -> None:
        if self.ended:
            return
        self.ended = True
        self._emit(Failed(self.request_id, failure.message, failure.retry_after))

    def _usage(self) -> Usage:
        usage, timings = self.assembly.usage, self.assembly.timings
        prompt = prompt_tokens(usage, timings)
        if prompt is None:  # the server did not say: estimate from the characters sent
            prompt = estimate_tokens("".join(str(message_json(m).get("content") or "") for m in self.messages))
        completion = completion_tokens(usage, timings)
        return Usage(prompt, cached_tokens(usage, timings),
                     completion if completion is not None else self.assembly.content_chunks)

    def _timings(self) -> Timings:
        now = time.monotonic()
        first = self.first_text_at or now
        ttft, decode = first - self.started_at, now - first
        completion = self._usage().completion_tokens
        server_rate = (self.assembly.timings or {}).get("predicted_per_second")
        rate = (float(server_rate) if isinstance(server_rate, (int, float))
                else (completion - 1) / decode if decode > 0 and completion > 1 else 0.0)
        return Timings(queued_s=0.0, prefill_s=ttft, time_to_first_token_s=ttft, decode_s=decode,
                       decode_tokens_per_s=rate)

    def _emit(self, event: Event) -> None:
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 -- a listener's bug must not end the stream thread
            log.exception("a listener failed on %s", type(event).__name__)


def _read_bounded(response: httpx.Response) -> bytes:
    data = b""
    try:
        for part in response.iter_bytes():
            data += part
            if len(data) >= MAX_ERROR_BODY:
                break
    except httpx.HTTPError:
        pass  # what arrived is enough for a message
    return data[:MAX_ERROR_BODY]


def _wake_reader(response: httpx.Response | None) -> None:
    """Unblock the thread reading `response`: shut its socket down (closing it from another
    thread would leave a blocked read waiting for the timeout)."""
    if response is None:
        return
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


def _is_llama_cpp(card) -> bool:
    return isinstance(card, dict) and (card.get("owned_by") == "llamacpp" or isinstance(card.get("meta"), dict))


def _card_context(card: dict) -> int | None:
    """The context size a /models card states: vLLM and SGLang `max_model_len`, llama.cpp
    `meta.n_ctx_train`, some proxies `context_length`."""
    meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
    for value in (card.get("max_model_len"), card.get("context_length"), meta.get("n_ctx_train")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


__all__ = ["DEFAULT_SESSION_HEADER", "RemoteBackend", "RemoteModel", "RemoteSettings",
           "chat_request_body", "error_detail", "estimate_tokens"]
