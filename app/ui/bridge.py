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
from collections.abc import Sequence
from dataclasses import replace

from app.documents import DocumentError, extract_document, format_for_prompt
from app.engine.device import DTYPE_CHOICES, available_devices, resolve_device
from app.engine.engine import EngineConfig
from app.engine.sampling import SamplingParams
from app.engine.session import ModelSession, NoModelError
from app.models.chat_template import Message
from app.models.embedded import ensure_embedded_model
from app.ui.builtin_models import ensure_builtin, refusal_of
from app.models.errors import ModelError
from app.models.model_facts import read_model_facts
from app.ui.qt import QObject, QThread, Signal, Slot

# Below this many free context tokens a reply is not worth starting.
MIN_REPLY_TOKENS = 16


class EngineBridge(QObject):
    # -> worker (queued)
    _load = Signal(str, str, str, int, int)
    _submit = Signal(str, object, object)
    _count = Signal(str, str)
    _read_document = Signal(str, str)
    _inspect = Signal(str)
    _prepare_embedded = Signal(str)
    _prepare_builtin = Signal(str, str)
    _continue = Signal(str, object, str, object)
    _count_chat = Signal(int, object)
    _probe_devices = Signal()

    # -> GUI
    modelLoading = Signal(str)  # what is happening, e.g. "Loading Gemma 3 270m…"
    modelLoaded = Signal(object)  # ModelInfo
    modelFailed = Signal(str)
    modelKept = Signal(object, str)  # the ModelInfo still loaded, why the new one failed
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

    def __init__(self):
        super().__init__()
        self.session = ModelSession()
        self._thread = QThread()
        self._thread.setObjectName("ferrox-worker")
        self.moveToThread(self._thread)
        self._load.connect(self._do_load)
        self._submit.connect(self._do_submit)
        self._count.connect(self._do_count)
        self._read_document.connect(self._do_read_document)
        self._inspect.connect(self._do_inspect)
        self._prepare_embedded.connect(self._do_prepare_embedded)
        self._prepare_builtin.connect(self._do_prepare_builtin)
        self._continue.connect(self._do_continue)
        self._count_chat.connect(self._do_count_chat)
        self._probe_devices.connect(self._do_probe_devices)
        self._thread.start()
        # A script that never runs the event loop to its end still stops the thread cleanly.
        atexit.register(self.shutdown)

    # ---- called from the GUI thread ----------------------------------------------------

    def prepare_embedded(self, models_dir: str) -> None:
        self._prepare_embedded.emit(models_dir)

    def prepare_builtin(self, key: str, models_dir: str) -> None:
        """Put built-in model `key` in `models_dir` (embeddedProgress, then embeddedReady)."""
        self._prepare_builtin.emit(key, models_dir)

    def probe_devices(self) -> None:
        """Ask which devices exist (answered by devicesFound)."""
        self._probe_devices.emit()

    def continue_reply(self, request_id: str, messages: Sequence[Message], partial: str,
                       params: SamplingParams) -> None:
        """Carry on `partial`, the assistant reply after `messages` (cut by the token
        limit): no new user turn, the same reply continues from its cached KV."""
        self._continue.emit(request_id, tuple(messages), partial, params)

    def count_chat(self, chat_id: int, messages: Sequence[Message]) -> None:
        """Tokens the conversation takes as a prompt (answered by chatCounted)."""
        self._count_chat.emit(chat_id, tuple(messages))

    def load(self, path: str, device: str = "auto", dtype: str = "auto",
             prefill_chunk: int = 512, context_size: int = 0) -> None:
        """context_size 0 = the model's full context."""
        self._load.emit(path, device, dtype, prefill_chunk, context_size)

    def submit(self, request_id: str, messages: Sequence[Message], params: SamplingParams) -> None:
        self._submit.emit(request_id, tuple(messages), params)

    def abort(self, request_id: str) -> None:
        self.session.abort(request_id)

    def count_tokens(self, key: str, text: str) -> None:
        self._count.emit(key, text)

    def read_document(self, key: str, path: str) -> None:
        self._read_document.emit(key, path)

    def inspect_model(self, path: str) -> None:
        self._inspect.emit(path)

    def shutdown(self) -> None:
        """Stop generation, free the model and end the worker thread (blocks briefly).
        Safe to call twice (window close, then application quit)."""
        if not self._thread.isRunning():
            return
        self.session.close()
        self._thread.quit()
        self._thread.wait(10_000)

    # ---- the worker thread -------------------------------------------------------------

    @Slot(str)
    def _do_prepare_embedded(self, models_dir: str) -> None:
        try:
            path = ensure_embedded_model(models_dir, self.embeddedProgress.emit)
        except ModelError as exc:
            self.modelFailed.emit(str(exc))
            return
        self.embeddedReady.emit(str(path))

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

    @Slot(str, str, str, int, int)
    def _do_load(self, path: str, device: str, dtype: str, prefill_chunk: int,
                 context_size: int) -> None:
        self.modelLoading.emit(f"Loading {path.rsplit('/', 1)[-1]}…")
        before = self.session.info
        try:
            # A device that does not exist is refused before the loaded model is let go.
            resolve_device(device)
            config = EngineConfig(prefill_chunk=prefill_chunk, context_limit=context_size or None)
            info = self.session.load(path, device, dtype, config)
        except (ModelError, ValueError, OSError, RuntimeError) as exc:
            kept = self.session.info
            if kept is not None and kept == before:  # failed before the old model was let go
                self.modelKept.emit(kept, str(exc))
            else:
                self.modelFailed.emit(str(exc))
            return
        self.modelLoaded.emit(info)

    @Slot(str, object, object)
    def _do_submit(self, request_id: str, messages: tuple, params: SamplingParams) -> None:
        try:
            prompt = self.session.chat_prompt(messages)
        except (NoModelError, ValueError) as exc:
            self.submitFailed.emit(request_id, str(exc))
            return
        self._submit_prompt(request_id, prompt, params)

    @Slot(str, object, str, object)
    def _do_continue(self, request_id: str, messages: tuple, partial: str,
                     params: SamplingParams) -> None:
        try:
            prompt = self.session.continuation_prompt(messages, partial)
        except (NoModelError, ValueError) as exc:
            self.submitFailed.emit(request_id, str(exc))
            return
        self._submit_prompt(request_id, prompt, params)

    def _submit_prompt(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        context = self.session.info.context_length
        room = context - len(prompt)
        if room < MIN_REPLY_TOKENS:
            self.contextOverflow.emit(request_id, len(prompt), context)
            return
        if params.max_tokens > room:  # the reply may use what the context has left
            params = replace(params, max_tokens=room)
        self.session.submit(prompt, params, self.event.emit, request_id)

    @Slot(str, str)
    def _do_count(self, key: str, text: str) -> None:
        try:
            self.tokensCounted.emit(key, self.session.count_tokens(text))
        except NoModelError:
            self.tokensCounted.emit(key, -1)

    @Slot(int, object)
    def _do_count_chat(self, chat_id: int, messages: tuple) -> None:
        try:
            self.chatCounted.emit(chat_id, len(self.session.chat_prompt(messages)))
        except (NoModelError, ValueError):
            pass  # no model: the meter stays empty until one is loaded

    @Slot(str, str)
    def _do_read_document(self, key: str, path: str) -> None:
        try:
            document = extract_document(path)
        except DocumentError as exc:
            self.documentFailed.emit(key, str(exc))
            return
        try:
            tokens = self.session.count_tokens(format_for_prompt(document))
        except NoModelError:
            tokens = -1
        self.documentRead.emit(key, document, tokens)

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
