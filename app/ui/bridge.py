"""The GUI's one door to the engine: a QObject living in a worker QThread.

Slow work (loading a model, tokenizing a long conversation or document, reading a model
file's header) runs in the worker thread, reached through queued signals. Engine events
arrive on the engine's own thread and leave as Qt signals, which Qt queues to the GUI
thread. Every signal carries plain data: ints, strings, frozen dataclasses.

Never touch widgets from here. `abort` is the one direct call the GUI makes: it only
enqueues, so it is safe and instant from any thread, even while the worker is busy loading.
"""

from __future__ import annotations

import atexit
import json
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from app.backends.base import BackendError
from app.backends.registry import build_backend
from app.chat.budget import MIN_REPLY_TOKENS, plan_reply
from app.documents import DocumentError, count_tokens, extract_text, format_for_prompt
from app.engine.device import DTYPE_CHOICES, available_devices, resolve_device
from app.engine.engine import EngineConfig
from app.engine.events import Failed, Finished
from app.engine.kv_disk import KVDiskStore, StoreIdentity, default_budget_bytes
from app.engine.sampling import SamplingParams
from app.engine.session import ModelSession, NoModelError
from app.models.chat_template import Message
from app.ui.builtin_models import ensure_builtin, refusal_of
from app.models.errors import ModelError
from app.models.model_facts import read_model_facts
from app.storage.errors import StorageError
from app.ui.remote_models import DEFAULT_REMOTE_CONTEXT, RemoteModelInfo
from app.ui.qt import QObject, QThread, Signal, Slot

# Template tokens a message adds around its text (role header, end of turn), for a remote
# model's conversation count: its template is on the server.
REMOTE_TOKENS_PER_MESSAGE = 4

# Two kinds of backend serve the window: this process's engine (`self.session`, for the kinds
# that need a loaded local model) and a backend built from a saved connection by its kind's
# builder (app/backends/registry.py: remote, or any kind added there). The bridge names no
# kind: it asks the registry to build one and talks to it through the ChatBackend seam.


class EngineBridge(QObject):
    # -> worker (queued)
    _load = Signal(str, str, str, int, int, object)
    _load_backend = Signal(object, object, object)  # ConnectionStore, Route, context or None
    _submit = Signal(str, object, object, object, str)
    _count = Signal(str, str)
    _read_document = Signal(str, str)
    _inspect = Signal(str)
    _prepare_builtin = Signal(str, str)
    _count_chat = Signal(int, object)
    _probe_devices = Signal()
    _forget_owner = Signal(str)
    _serve_api = Signal(int)  # port; -1 stops

    # -> GUI
    modelLoading = Signal(str)  # what is happening, e.g. "Loading Gemma 3 270m…"
    modelLoaded = Signal(object)  # ModelInfo
    modelFailed = Signal(str)
    modelKept = Signal(object, str)  # the ModelInfo still loaded, why the new one failed
    # The loaded model's ModelInfo once the background CPU measurement settled its format
    # (emitted from the tuner's thread; queued to the GUI's).
    policySettled = Signal(object)
    embeddedReady = Signal(str)  # path
    embeddedProgress = Signal(int, int)  # bytes done, total
    event = Signal(object)  # an engine Event
    submitFailed = Signal(str, str)  # request id, message
    contextOverflow = Signal(str, int, int)  # request id, prompt tokens, context length
    tokensCounted = Signal(str, int)  # key, tokens
    documentRead = Signal(str, object, int)  # key, Document, tokens (-1 without a model)
    documentFailed = Signal(str, str)  # key, message
    modelInspected = Signal(str, object)  # path, ModelFacts
    modelRejected = Signal(str, str)  # path, message
    chatCounted = Signal(int, int)  # chat id, prompt tokens of the whole conversation
    devicesFound = Signal(object, object)  # devices that exist here ("auto" first), dtypes
    # The local API server's address ("" while it is off) and, when it could not start, why.
    apiServerChanged = Signal(str, str)

    def __init__(self):
        super().__init__()
        self.session = ModelSession()
        self.session.on_policy = self.policySettled.emit
        # The chosen connection model's backend (a ChatBackend its kind built), or None while
        # the local engine serves. Set and cleared in the worker; `abort` reads it from the
        # GUI thread.
        self.backend = None
        # Which such backend runs each of its replies (a chat switched to another model keeps
        # its running reply on the old one); backends no longer chosen close once idle.
        self._backend_of: dict[str, object] = {}
        self._retired: list = []
        # What the loaded local model was loaded with: picking it again (a chat switched back
        # from a remote model) serves it at once instead of loading it again.
        self._local_args: tuple | None = None
        self._thread = QThread()
        self._thread.setObjectName("ferrox-worker")
        self.moveToThread(self._thread)
        self._load.connect(self._do_load)
        self._load_backend.connect(self._do_load_backend)
        self._submit.connect(self._do_submit)
        self._count.connect(self._do_count)
        self._read_document.connect(self._do_read_document)
        self._inspect.connect(self._do_inspect)
        self._prepare_builtin.connect(self._do_prepare_builtin)
        self._count_chat.connect(self._do_count_chat)
        self._probe_devices.connect(self._do_probe_devices)
        self._forget_owner.connect(self._do_forget_owner)
        self._serve_api.connect(self._do_serve_api)
        # The API server inside the app (app/server/embedded.py): worker thread only.
        self._api = None
        self._api_port: int | None = None
        # Reading a document can be cancelled from the GUI thread (its chip removed).
        self._document_cancels: dict[str, threading.Event] = {}
        self._kv_root: Path | None = None  # the disk cache's folder (worker thread only)
        self._thread.start()
        # A script that never runs the event loop to its end still stops the thread cleanly.
        atexit.register(self.shutdown)

    # ---- called from the GUI thread ----------------------------------------------------

    def prepare_builtin(self, key: str, models_dir: str) -> None:
        """Put built-in model `key` in `models_dir` (embeddedProgress, then embeddedReady)."""
        self._prepare_builtin.emit(key, models_dir)

    def probe_devices(self) -> None:
        """Ask which devices exist (answered by devicesFound)."""
        self._probe_devices.emit()

    def count_chat(self, chat_id: int, messages: Sequence[Message]) -> None:
        """Tokens the conversation takes as a prompt (answered by chatCounted)."""
        self._count_chat.emit(chat_id, tuple(messages))

    def load(self, path: str, device: str = "auto", dtype: str = "auto",
             prefill_chunk: int = 512, context_size: int = 0,
             disk_cache: tuple[str, int | None] | None = None) -> None:
        """context_size 0 = the model's full context. `disk_cache`: (folder, budget bytes,
        None for the default) to keep conversations' KV pages on disk across restarts; a
        budget of 0, or no `disk_cache`, keeps them in memory only."""
        self._load.emit(path, device, dtype, prefill_chunk, context_size, disk_cache)

    def load_backend(self, connections, route, context_length: int | None) -> None:
        """Serve the next replies from `route`'s model on its saved connection (a Route of
        app.ui.remote_models, of any kind that does not need a local model; `connections`
        the ConnectionStore), built by the kind's builder (app/backends/registry.py).
        `context_length`: the model's context as the person set it or the server reported
        it, None when nobody said (replies are then not cut to fit here, and the window's
        figures assume DEFAULT_REMOTE_CONTEXT).
        A remote server is not asked: a chat remembers its model even while the server is
        down; a wrong name shows on the first reply. Answered by modelLoaded (a
        RemoteModelInfo) or modelFailed."""
        self._load_backend.emit(connections, route, context_length)

    def submit(self, request_id: str, messages: Sequence[Message], params: SamplingParams,
               cache_owner: str | None = None, partial: str = "") -> None:
        """`cache_owner` (a chat id) is recorded with the pages saved to disk, so
        `forget_cache_owner` can delete them when the chat is deleted for good (a remote
        model gets it as the session header). `partial` (Continue): the assistant reply after
        `messages`, cut by the token limit, which the model carries on -- no new user turn;
        locally the same reply continues from its cached KV."""
        self._submit.emit(request_id, tuple(messages), params, cache_owner, partial)

    def submit_request(self, request) -> None:
        """A chat service's SubmitRequest (app/chat/service.py)."""
        self.submit(request.request_id, request.messages, request.params,
                    cache_owner=request.session_id or None, partial=request.partial)

    def forget_cache_owner(self, owner: str) -> None:
        """Delete the disk-cached pages only `owner` used, for every model (in the worker)."""
        self._forget_owner.emit(owner)

    def serve_api(self, port: int | None) -> None:
        """Serve the loaded local model to programs on this computer at
        http://127.0.0.1:`port`/v1 (0: a free port), or stop (None). Answered by
        apiServerChanged."""
        self._serve_api.emit(-1 if port is None else port)

    def abort(self, request_id: str) -> None:
        backend = self._backend_of.get(request_id) or self.backend
        if backend is not None:
            backend.abort(request_id)  # only enqueues (a remote one sets a flag, wakes the reader)
        self.session.abort(request_id)

    def count_tokens(self, key: str, text: str) -> None:
        self._count.emit(key, text)

    def read_document(self, key: str, path: str) -> None:
        self._document_cancels[key] = threading.Event()
        self._read_document.emit(key, path)

    def cancel_document(self, key: str) -> None:
        """Stop reading or counting document `key` (instant; it reports nothing more)."""
        event = self._document_cancels.get(key)
        if event is not None:
            event.set()

    def inspect_model(self, path: str) -> None:
        self._inspect.emit(path)

    @staticmethod
    def disk_cache_default_bytes(folder: str | Path) -> int:
        """The disk cache's default budget for a data folder (sized to its disk)."""
        return default_budget_bytes(Path(folder))

    def shutdown(self) -> None:
        """Stop generation, free the model and end the worker thread (blocks briefly).
        Safe to call twice (window close, then application quit)."""
        if not self._thread.isRunning():
            return
        for backend in [self.backend, *self._retired]:
            if backend is not None:
                backend.close()
        api, self._api = self._api, None
        if api is not None:
            api.stop()
        self.session.close()
        self._thread.quit()
        self._thread.wait(10_000)

    # ---- the worker thread -------------------------------------------------------------

    @Slot(str, str)
    def _do_prepare_builtin(self, key: str, models_dir: str) -> None:
        try:
            path = ensure_builtin(key, models_dir, self.embeddedProgress.emit)
        except ModelError as exc:
            self.modelFailed.emit(str(exc))
            return
        self.embeddedReady.emit(str(path))

    @Slot()
    def _do_probe_devices(self) -> None:
        self.devicesFound.emit(available_devices(), DTYPE_CHOICES)

    @Slot(int)
    def _do_serve_api(self, port: int) -> None:
        from app.server.embedded import EmbeddedServer  # (web framework: loaded on first use)
        from app.server.serve import ServeError

        if self._api is not None and port != self._api_port:
            self._api.stop()
            self._api = self._api_port = None
        if port < 0:
            self.apiServerChanged.emit("", "")
            return
        if self._api is None:
            api = EmbeddedServer(self.session, port)
            try:
                api.start()
            except ServeError as exc:
                self.apiServerChanged.emit("", str(exc))
                return
            self._api, self._api_port = api, port
        self.apiServerChanged.emit(self._api.url, "")

    @Slot(str, str, str, int, int, object)
    def _do_load(self, path: str, device: str, dtype: str, prefill_chunk: int,
                 context_size: int, disk_cache) -> None:
        args = (path, device, dtype, prefill_chunk, context_size, disk_cache)
        if self.session.info is not None and args == self._local_args:
            self._drop_backend()  # still loaded: it serves again, its cache intact
            self.modelLoaded.emit(self.session.info)
            return
        self.modelLoading.emit(f"Loading {path.rsplit('/', 1)[-1]}…")
        self._drop_backend()  # a local model serves from now on (or none, if it fails)
        self._local_args = None
        before = self.session.info
        # Read by session.load: the store opens (or stays off) with the model. The folder is
        # remembered even when the cache is off: deleting a chat still deletes its pages.
        self._kv_root = Path(disk_cache[0]) if disk_cache else None
        on = disk_cache is not None and disk_cache[1] != 0
        self.session.kv_dir = self._kv_root if on else None
        self.session.kv_budget_bytes = disk_cache[1] if on else None
        try:
            # A device that does not exist is refused before the loaded model is let go.
            resolve_device(device)
            config = EngineConfig(prefill_chunk=prefill_chunk, context_limit=context_size or None)
            # Each stage of the load, as a sentence for the status bar (queued to the GUI).
            info = self.session.load(path, device, dtype, config, progress=self.modelLoading.emit)
        except (ModelError, ValueError, OSError, RuntimeError) as exc:
            kept = self.session.info
            if kept is not None and kept == before:  # failed before the old model was let go
                self.modelKept.emit(kept, str(exc))
            else:
                self.modelFailed.emit(str(exc))
            return
        self._local_args = args
        self.modelLoaded.emit(info)

    def _drop_backend(self) -> None:
        """The chosen connection backend is no longer chosen: it closes once its replies end
        (another chat's stream is never cut by a model switch)."""
        backend, self.backend = self.backend, None
        if backend is not None:
            self._retired.append(backend)
        running = list(self._backend_of.values())
        for old in [b for b in self._retired if not any(b is r for r in running)]:
            self._retired.remove(old)
            old.close()

    @Slot(object, object, object)
    def _do_load_backend(self, connections, route, context_length) -> None:
        self.modelLoading.emit(f"Connecting to {route.model}…")
        try:
            connection = connections.get_connection(route.connection_id)
            backend = build_backend(route.kind, connections, connection, route.model, context_length)
        except (StorageError, BackendError, ValueError) as exc:
            self.modelFailed.emit(str(exc))
            return
        self._drop_backend()
        model = backend.describe()
        self.backend = backend
        self.modelLoaded.emit(RemoteModelInfo(
            route.key, model.name, model.location,
            model.context_length or context_length or DEFAULT_REMOTE_CONTEXT,
            architecture=route.kind, dtype=route.kind))

    @Slot(str, object, object, object, str)
    def _do_submit(self, request_id: str, messages: tuple, params: SamplingParams,
                   cache_owner, partial: str) -> None:
        backend = self.backend
        if backend is not None:  # events arrive on the reply's own thread
            params = self._backend_budget(request_id, backend, messages, params, partial)
            if params is None:
                return
            self._backend_of[request_id] = backend
            backend.submit_chat(messages, params, self._backend_event, request_id,
                                session_id=cache_owner, partial=partial)
            return
        try:
            prompt = (self.session.continuation_prompt(messages, partial) if partial
                      else self.session.chat_prompt(messages))
        except (NoModelError, ValueError) as exc:
            self.submitFailed.emit(request_id, str(exc))
            return
        # The context budget (app/chat/budget.py): the reply may use what the context has
        # left; a prompt that leaves too little is refused before it is sent.
        context = self.session.info.context_length
        plan = plan_reply(context, len(prompt), params.max_tokens, min_reply=MIN_REPLY_TOKENS)
        if not plan.fits:
            self.contextOverflow.emit(request_id, len(prompt), context)
            return
        if plan.max_tokens != params.max_tokens:
            params = replace(params, max_tokens=plan.max_tokens)
        self.session.submit(prompt, params, self.event.emit, request_id, cache_owner)

    def _backend_budget(self, request_id: str, backend, messages: tuple, params: SamplingParams,
                        partial: str) -> SamplingParams | None:
        """The context budget for a connection's model, as for the local one: the reply's
        max_tokens is cut to the room its context leaves, and a conversation that leaves too
        little is refused here (contextOverflow, None) instead of by the server's error.
        The context is the one set for the connection or reported by the server; when
        nobody said, or the count fails, the request goes as asked (the server decides)."""
        model = backend.describe()
        context = model.context_length if model is not None else None
        if not context:
            return params
        try:
            prompt = self._count_backend_chat(backend, messages)
            if partial:
                prompt += backend.count_tokens(partial)
        except BackendError:
            return params
        plan = plan_reply(context, prompt, params.max_tokens, min_reply=MIN_REPLY_TOKENS)
        if not plan.fits:
            self.contextOverflow.emit(request_id, prompt, context)
            return None
        return params if plan.max_tokens == params.max_tokens else replace(params, max_tokens=plan.max_tokens)

    def _backend_event(self, event) -> None:
        """A connection backend's event (on its reply's thread): forget its backend once the
        reply ends."""
        if isinstance(event, (Finished, Failed)):
            self._backend_of.pop(event.request_id, None)
        self.event.emit(event)

    @Slot(str)
    def _do_forget_owner(self, owner: str) -> None:
        """The loaded model's store through the engine, then every other model's folder
        under the cache folder (a chat may have been answered by several models)."""
        self.session.forget_cache_owner(owner)
        root = self._kv_root
        if root is None or not root.is_dir():
            return
        for folder in root.iterdir():
            try:
                identity = StoreIdentity(**json.loads((folder / "identity.json").read_text()))
            except (OSError, ValueError, TypeError):
                continue  # not a store folder (fingerprints.json, a stray file)
            if identity.folder_name == folder.name:
                KVDiskStore(root, identity, self.session.kv_budget_bytes or 0).forget_owner(owner)

    @staticmethod
    def _count_backend_chat(backend, messages: tuple) -> int:
        """A connection model's conversation: each message's text counted by the backend (a
        server's /tokenize, cached per text, or the estimate), plus its template's few
        tokens (the template is on the server)."""
        return sum(backend.count_tokens(m.content) + REMOTE_TOKENS_PER_MESSAGE for m in messages)

    @Slot(str, str)
    def _do_count(self, key: str, text: str) -> None:
        backend = self.backend
        if backend is not None:
            self.tokensCounted.emit(key, backend.count_tokens(text))
            return
        try:
            self.tokensCounted.emit(key, self.session.count_tokens(text))
        except NoModelError:
            self.tokensCounted.emit(key, -1)

    @Slot(int, object)
    def _do_count_chat(self, chat_id: int, messages: tuple) -> None:
        backend = self.backend
        if backend is not None:
            self.chatCounted.emit(chat_id, self._count_backend_chat(backend, messages))
            return
        try:
            self.chatCounted.emit(chat_id, len(self.session.chat_prompt(messages)))
        except (NoModelError, ValueError):
            pass  # no model: the meter stays empty until one is loaded

    @Slot(str, str)
    def _do_read_document(self, key: str, path: str) -> None:
        cancel = self._document_cancels.get(key) or threading.Event()
        try:
            document = extract_text(path, cancel=cancel)
            tokens = self._count_document(document, cancel)
        except DocumentError as exc:
            if not cancel.is_set():  # a cancelled read was removed by the person: no alert
                self.documentFailed.emit(key, str(exc))
            return
        finally:
            self._document_cancels.pop(key, None)
        self.documentRead.emit(key, document, tokens)

    def _count_document(self, document, cancel: threading.Event) -> int:
        """Tokens of the document as the prompt holds it (-1 without a model), counted in
        bounded chunks (app.documents.count_tokens) so a huge file neither stalls nor
        ignores a cancel."""
        backend = self.backend
        if backend is not None:  # the server's count (cached per text) or the estimate
            return backend.count_tokens(format_for_prompt(document))
        try:
            self.session.count_tokens("")
        except NoModelError:
            return -1
        # count_tokens wants an encode callable; only the length of its result is used.
        return count_tokens(lambda text: range(self.session.count_tokens(text)),
                            format_for_prompt(document), cancel=cancel, name=document.name).tokens

    @Slot(str)
    def _do_inspect(self, path: str) -> None:
        try:
            facts = read_model_facts(path)
        except (ModelError, OSError) as exc:
            self.modelRejected.emit(path, str(exc))
            return
        if not facts.supported:
            self.modelRejected.emit(path, refusal_of(facts))
            return
        self.modelInspected.emit(path, facts)
