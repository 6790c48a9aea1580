"""What the main window does: chats, sending, streaming, versions, documents, models.

Runs entirely on the GUI thread. It talks to the engine only through `EngineBridge`
(queued signals in, Qt signals out) and to the store directly (every store call is short).
Several chats may generate at once; switching chats never touches a stream, it only changes
which chat the message view shows.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

from app.documents import Document, format_for_prompt
from app.engine.events import Failed, Finished, PrefillProgress, Queued, Token
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message as PromptMessage
from app.models.embedded import EMBEDDED_MODEL_NAME
from app.paths import models_dir
from app.storage import ChatStore, NewAttachment, StorageError
from app.ui.bridge import EngineBridge
from app.ui.main_window import MainWindow
from app.ui.qt import QObject, QTimer, Qt, QtWidgets
from app.ui.replies import ActiveReply, ReplyBook
from app.ui.view_models import (COMPLETE, ERROR, PREFILLING, QUEUED, STOPPED, STREAMING,
                                AttachmentChip, MessageItem)

EMBEDDED_KEY = "embedded"
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "max_tokens", "seed")
DEFAULT_SAMPLING = {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0,
                    "max_tokens": 1024, "seed": None}
ENGINE_DEFAULTS = {"device": "auto", "dtype": "auto", "prefill_chunk": 512, "context_size": 0}


@dataclass
class PendingAttachment:
    key: str
    name: str
    document: Document | None = None
    tokens: int | None = None


class ChatController(QObject):
    """A QObject living in the GUI thread: the bridge's signals, emitted from the worker and
    engine threads, reach its methods queued onto the GUI thread. (Connected to a plain
    Python object they would run on the emitting thread.)"""

    def __init__(self, window: MainWindow, store: ChatStore, bridge: EngineBridge, data_dir: Path,
                 model_override: str | None = None, device_override: str | None = None):
        super().__init__(window)
        self.window, self.store, self.bridge = window, store, bridge
        self.data_dir = data_dir
        self.model_override = model_override
        self.device_override = device_override
        self.replies = ReplyBook()
        self.alerts: list[tuple[str, str]] = []  # every alert shown, newest last
        self.model_info = None
        self.model_error = ""
        self.current_chat_id: int | None = None
        self.pending: dict[int, list[PendingAttachment]] = {}
        self._request_ids = itertools.count(1)
        self._attachment_ids = itertools.count(1)
        self._deleted_chat_id: int | None = None
        self._last_usage: dict[int, tuple[int, int, int]] = {}  # chat -> used, cached, context
        self._search_timer = QTimer(singleShot=True, interval=200)
        self._undo_timer = QTimer(singleShot=True, interval=8000)
        self._save_timer = QTimer(interval=250)  # streaming replies reach the disk on this beat
        self._connect()
        self._save_timer.start()

    # ---- wiring ------------------------------------------------------------------------

    def _connect(self) -> None:
        w, b = self.window, self.bridge
        w.new_chat_button.clicked.connect(self.new_chat)
        w.new_chat_action.triggered.connect(self.new_chat)
        w.chat_list.currentItemChanged.connect(self._on_chat_selected)
        w.chat_list.contextRequested.connect(self._chat_menu)
        w.search_box.textChanged.connect(lambda _: self._search_timer.start())
        self._search_timer.timeout.connect(self.refresh_chat_list)
        w.composer.sendRequested.connect(self.send)
        w.composer.stopRequested.connect(self.stop)
        w.stop_action.triggered.connect(self.stop)
        w.composer.attachRequested.connect(self._choose_documents)
        w.composer.attachmentRemoved.connect(self._remove_attachment)
        w.composer.filesDropped.connect(self.add_files)
        w.filesDropped.connect(self.add_files)
        w.message_view.regenerateRequested.connect(self.regenerate)
        w.message_view.editRequested.connect(self.edit_and_resend)
        w.message_view.versionRequested.connect(self.switch_version)
        w.message_view.copied.connect(lambda _: w.statusBar().showMessage("Copied", 2000))
        w.model_picker.activated.connect(self._on_model_picked)
        w.add_model_action.triggered.connect(self._choose_model_file)
        w.remove_model_action.triggered.connect(self.remove_current_model)
        w.settings_action.triggered.connect(self._open_preferences)
        w.chat_settings_action.triggered.connect(self._open_chat_settings)
        w.import_action.triggered.connect(self._import_chat)
        w.export_md_action.triggered.connect(lambda: self._export_chat("md"))
        w.export_json_action.triggered.connect(lambda: self._export_chat("json"))
        w.undo_button.clicked.connect(self.undo_delete)
        self._undo_timer.timeout.connect(self._forget_undo)
        self._save_timer.timeout.connect(self._save_streams)
        w.closing.connect(self.shutdown)
        b.modelLoading.connect(self._on_model_loading)
        b.modelLoaded.connect(self._on_model_loaded)
        b.modelFailed.connect(self._on_model_failed)
        b.embeddedReady.connect(self._on_embedded_ready)
        b.embeddedProgress.connect(self._on_embedded_progress)
        b.event.connect(self._on_engine_event)
        b.submitFailed.connect(self._on_submit_failed)
        b.contextOverflow.connect(self._on_context_overflow)
        b.documentRead.connect(self._on_document_read)
        b.documentFailed.connect(self._on_document_failed)
        b.modelInspected.connect(self._on_model_inspected)
        b.modelRejected.connect(self._on_model_rejected)

    def start(self) -> None:
        """Show the chats and start loading the model (in the worker)."""
        self.store.mark_interrupted()
        self.refresh_models()
        self.refresh_chat_list()
        if self.window.chat_list.count():
            self.window.chat_list.setCurrentRow(0)
        else:
            self.new_chat()
        self._update_send_state()
        self.load_selected_model()

    # ---- models ------------------------------------------------------------------------

    def engine_settings(self) -> dict:
        settings = dict(ENGINE_DEFAULTS)
        settings.update(self.store.get_setting("engine", {}) or {})
        context = self.model_defaults().get("context_size")
        if context is not None:  # remembered for this model
            settings["context_size"] = context
        if self.device_override:
            settings["device"] = self.device_override
        return settings

    # Per-model defaults (context size, sampling): the built-in model's live in the settings,
    # an added model's in its record.

    def _model_record(self):
        key = self.window.model_picker.currentData()
        return next((m for m in self.store.list_models() if m.path == key), None)

    def model_defaults(self) -> dict:
        record = self._model_record()
        if record is not None:
            return dict(record.defaults)
        return dict(self.store.get_setting("model_defaults:embedded", {}) or {})

    def save_model_defaults(self, changes: dict) -> None:
        record = self._model_record()
        if record is not None:
            self.store.update_model_defaults(record.id, changes)
        else:
            merged = self.model_defaults()
            merged.update(changes)
            self.store.set_setting("model_defaults:embedded", merged)

    def remove_current_model(self) -> None:
        """Forget the selected added model (its file stays) and go back to the built-in one."""
        record = self._model_record()
        if record is None:
            self._alert("Remove model", "The built-in model cannot be removed.")
            return
        if not self._confirm("Remove model", f"Remove {record.name} from the list? The file "
                             f"{record.path} stays where it is."):
            return
        self.store.remove_model(record.id)
        self.store.set_setting("model", EMBEDDED_KEY)
        self.model_override = None
        self.refresh_models()
        self.load_selected_model()

    def refresh_models(self) -> None:
        picker = self.window.model_picker
        picker.clear()
        picker.addItem("Gemma 3 270M (built in)", EMBEDDED_KEY)
        for record in self.store.list_models():
            picker.addItem(record.name, record.path)
            picker.setItemData(picker.count() - 1, record.path, Qt.ToolTipRole)
        wanted = self.model_override or self.store.get_setting("model", EMBEDDED_KEY)
        if wanted not in (EMBEDDED_KEY, "default") and picker.findData(wanted) < 0:
            picker.addItem(Path(wanted).name, wanted)
        index = picker.findData(EMBEDDED_KEY if wanted == "default" else wanted)
        picker.setCurrentIndex(max(index, 0))

    def load_selected_model(self) -> None:
        key = self.window.model_picker.currentData()
        self.model_info = None
        self._update_send_state()
        if key == EMBEDDED_KEY:
            self.window.model_status.setText("Preparing the built-in model…")
            self.bridge.prepare_embedded(str(models_dir(self.data_dir)))
        else:
            self._load_path(key)

    def _load_path(self, path: str) -> None:
        settings = self.engine_settings()
        self.bridge.load(path, settings["device"], settings["dtype"], int(settings["prefill_chunk"]),
                         int(settings.get("context_size") or 0))

    def _on_embedded_progress(self, done: int, total: int) -> None:
        self.window.model_status.setText(
            f"Preparing the built-in model… {100 * done // max(total, 1)}%")

    def _on_embedded_ready(self, path: str) -> None:
        self._load_path(path)

    def _on_model_loading(self, message: str) -> None:
        self.window.model_status.setText(message)

    def _on_model_loaded(self, info) -> None:
        self.model_info = info
        picker = self.window.model_picker
        if picker.currentData() != EMBEDDED_KEY:
            picker.setItemText(picker.currentIndex(), info.name)
        self.model_error = ""
        self.window.model_status.setText(f"{info.name} ready (loaded in {info.load_seconds:.1f} s)")
        self.window.device_label.setText(f"{info.device} · {info.dtype}")
        self._update_send_state()
        self._update_context_meter()
        for chip in self._pending_for(self.current_chat_id):  # count what waited for a model
            if chip.document is not None and chip.tokens is None:
                self.bridge.count_tokens(chip.key, format_for_prompt(chip.document))

    def _on_model_failed(self, message: str) -> None:
        self.model_info = None
        self.model_error = message
        self.window.model_status.setText("No model loaded")
        self._update_send_state()
        self._alert("The model could not be loaded", message)

    def _on_model_picked(self, _index: int) -> None:
        key = self.window.model_picker.currentData()
        if self.replies and not self._confirm(
                "Switch models?", f"{len(self.replies)} repl{'y is' if len(self.replies) == 1 else 'ies are'} "
                "still being written. Stop them and switch?"):
            self.refresh_models()
            return
        self.store.set_setting("model", key)
        self.model_override = None
        self.load_selected_model()

    def _choose_model_file(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self.window, "Add a model", str(Path.home()),
                                                        "GGUF models (*.gguf)")
        if path:
            self.bridge.inspect_model(path)

    def _on_model_inspected(self, path: str, facts) -> None:
        try:
            record = self.store.add_model(path, {
                "name": facts.name, "architecture": facts.architecture,
                "size_bytes": facts.size_bytes, "quantization": facts.quantization,
                "context_length": facts.context_length})
        except StorageError as exc:
            self._alert("Could not add the model", str(exc))
            return
        self.window.statusBar().showMessage(f"Added {facts.describe()}", 8000)
        self.refresh_models()
        index = self.window.model_picker.findData(record.path)
        if index >= 0:
            self.window.model_picker.setCurrentIndex(index)
            self._on_model_picked(index)

    def _on_model_rejected(self, path: str, message: str) -> None:
        self._alert("This model cannot be added",
                                      f"{Path(path).name}: {message}")

    # ---- chat list ---------------------------------------------------------------------

    def refresh_chat_list(self) -> None:
        chat_list = self.window.chat_list
        chat_list.blockSignals(True)
        chat_list.clear()
        try:
            chats = self.store.list_chats(self.window.search_box.text().strip())
        except StorageError as exc:
            self.window.statusBar().showMessage(str(exc), 8000)
            chats = []
        for chat in chats:
            item = QtWidgets.QListWidgetItem(self._chat_label(chat))
            item.setData(Qt.UserRole, chat.id)
            item.setToolTip(chat.title)
            chat_list.addItem(item)
            if chat.id == self.current_chat_id:
                chat_list.setCurrentItem(item)
        chat_list.blockSignals(False)

    def _chat_label(self, chat) -> str:
        reply = self.replies.for_chat(chat.id)
        badge = f"  · {reply.list_badge()}" if reply else ""
        return f"{'📌 ' if chat.pinned else ''}{chat.title}{badge}"

    def _refresh_chat_item(self, chat_id: int) -> None:
        chat_list = self.window.chat_list
        for row in range(chat_list.count()):
            item = chat_list.item(row)
            if item.data(Qt.UserRole) == chat_id:
                item.setText(self._chat_label(self.store.get_chat(chat_id)))
                return

    def new_chat(self) -> None:
        chat = self.store.create_chat(settings=self._default_chat_settings())
        self.window.search_box.clear()
        self.current_chat_id = chat.id
        self.refresh_chat_list()
        self.show_chat(chat.id)
        self.window.composer.focus_input()

    def _default_chat_settings(self) -> dict:
        """Sampling for a new chat: built-in defaults < app-wide < this model's."""
        settings = dict(DEFAULT_SAMPLING)
        settings.update(self.store.get_setting("defaults", {}) or {})
        settings.update({k: v for k, v in self.model_defaults().items() if k in SAMPLING_KEYS})
        return settings

    def _on_chat_selected(self, current, _previous) -> None:
        if current is not None:
            self.show_chat(current.data(Qt.UserRole))

    def _chat_menu(self, chat_id: int, position) -> None:
        chat = self.store.get_chat(chat_id)
        menu = QtWidgets.QMenu(self.window)
        menu.addAction("Rename…", lambda: self.rename_chat(chat_id))
        menu.addAction("Unpin" if chat.pinned else "Pin", lambda: self.pin_chat(chat_id, not chat.pinned))
        menu.addAction("Export as Markdown…", lambda: self._export_chat("md", chat_id))
        menu.addAction("Export as JSON…", lambda: self._export_chat("json", chat_id))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_chat(chat_id))
        menu.popup(position)

    def rename_chat(self, chat_id: int, title: str | None = None) -> None:
        if title is None:
            title, ok = QtWidgets.QInputDialog.getText(self.window, "Rename chat", "Title:",
                                                       text=self.store.get_chat(chat_id).title)
            if not ok:
                return
        if title.strip():
            self.store.rename_chat(chat_id, title.strip())
            self.refresh_chat_list()
            if chat_id == self.current_chat_id:
                self.window.chat_title.setText(title.strip())

    def pin_chat(self, chat_id: int, pinned: bool) -> None:
        self.store.set_pinned(chat_id, pinned)
        self.refresh_chat_list()

    def delete_chat(self, chat_id: int) -> None:
        reply = self.replies.for_chat(chat_id)
        if reply:
            self.bridge.abort(reply.request_id)
        chat = self.store.delete_chat(chat_id)
        self._deleted_chat_id = chat_id
        self.window.undo_button.setText(f"Undo delete of “{chat.title[:30]}”")
        self.window.undo_button.show()
        self._undo_timer.start()
        if chat_id == self.current_chat_id:
            self.current_chat_id = None
        self.refresh_chat_list()
        if self.current_chat_id is None:
            if self.window.chat_list.count():
                self.window.chat_list.setCurrentRow(0)
            else:
                self.new_chat()

    def undo_delete(self) -> None:
        if self._deleted_chat_id is not None:
            self.store.restore_chat(self._deleted_chat_id)
            self.current_chat_id = self._deleted_chat_id
            self.refresh_chat_list()
            self.show_chat(self._deleted_chat_id)
        self._forget_undo()

    def _forget_undo(self) -> None:
        self._deleted_chat_id = None
        self.window.undo_button.hide()

    # ---- showing a chat ----------------------------------------------------------------

    def show_chat(self, chat_id: int) -> None:
        self.current_chat_id = chat_id
        chat = self.store.get_chat(chat_id)
        self.window.chat_title.setText(chat.title)
        items = [self._item_for(m) for m in self.store.active_path(chat_id)]
        view = self.window.message_view
        view.set_messages(items)
        if not items:
            view.set_placeholder("Start the conversation below. Drop documents to ask about them.")
        self._show_attachments()
        self._update_send_state()
        self._update_context_meter()

    def _item_for(self, message) -> MessageItem:
        versions = self.store.versions(message.id)
        reply = self.replies.for_chat(message.chat_id)
        live = reply is not None and reply.message_id == message.id
        text = reply.text if live else message.content
        status = reply.state if live else message.status
        meta = message.metadata or {}
        info = ""
        if message.role == "assistant" and not live and meta.get("tokens_per_s"):
            info = f"{meta['tokens_per_s']:.1f} tok/s · {meta.get('completion_tokens', 0)} tokens"
            if meta.get("cached_tokens"):
                info += f" · {meta['cached_tokens']:,} prompt tokens reused"
        return MessageItem(
            message_id=message.id, role=message.role, text=text, status=status,
            version_index=versions.index, version_count=versions.count,
            attachments=tuple(a.name for a in message.attachments), info=info,
            error=message.error or "", progress=reply.progress_text() if live else "")

    def _refresh_message(self, reply: ActiveReply) -> None:
        if reply.chat_id == self.current_chat_id:
            self.window.message_view.update_message(self._item_for(self.store.get_message(reply.message_id)))

    # ---- sending -----------------------------------------------------------------------

    def _update_send_state(self) -> None:
        composer = self.window.composer
        busy = self.current_chat_id is not None and self.replies.for_chat(self.current_chat_id) is not None
        composer.set_busy(busy)
        # Send stays clickable without a model: pressing it explains why nothing was sent
        # (a greyed-out button explains nothing), and the typed text is kept.
        if self.model_info is None:
            reason = self.model_error or "The model is still loading."
            composer.set_send_enabled(True, f"No model is loaded. {reason}")
        else:
            composer.set_send_enabled(True)

    def send(self, text: str) -> None:
        chat_id = self.current_chat_id
        if chat_id is None:
            return
        if self.model_info is None:
            self.window.statusBar().showMessage(
                "No model is loaded yet, so nothing was sent. "
                + (self.model_error or "Wait for the model to finish loading."), 8000)
            return
        if self.replies.for_chat(chat_id):
            self.window.statusBar().showMessage("This chat is still answering; stop it first.", 5000)
            return
        chips = self._pending_for(chat_id)
        if any(c.document is None for c in chips):
            self.window.statusBar().showMessage("Wait until the attachments are read.", 5000)
            return
        if not text.strip() and not chips:
            return
        attachments = [NewAttachment(name=c.name, kind=c.document.kind, text=c.document.text,
                                     token_count=max(c.tokens or 0, 0),
                                     size_bytes=c.document.size_bytes) for c in chips]
        try:
            with self.store.transaction():
                user = self.store.add_message(chat_id, "user", text.strip(), attachments=attachments)
                reply = self.store.add_message(chat_id, "assistant", "", status="streaming")
                self._maybe_title(chat_id, text, chips)
        except StorageError as exc:
            self._alert("Could not save the message", str(exc))
            return
        del user
        self.pending.pop(chat_id, None)
        self.window.composer.clear_text()
        self._start_reply(chat_id, reply.id)

    def _maybe_title(self, chat_id: int, text: str, chips: list[PendingAttachment]) -> None:
        chat = self.store.get_chat(chat_id)
        if chat.title == "New chat":
            title = " ".join(text.split())[:48] or (chips[0].name if chips else "New chat")
            self.store.rename_chat(chat_id, title)

    def _start_reply(self, chat_id: int, reply_id: int) -> None:
        """Submit the conversation up to the (empty, streaming) reply `reply_id`."""
        path = self.store.active_path(chat_id)
        upto = [m for m in path if m.id != reply_id]
        chat = self.store.get_chat(chat_id)
        messages = self._prompt_messages(chat, upto)
        request_id = f"chat{chat_id}-{next(self._request_ids)}"
        self.replies.add(ActiveReply(request_id, chat_id, reply_id))
        self.bridge.submit(request_id, messages, self._sampling_params(chat))
        if chat_id == self.current_chat_id:
            self.show_chat(chat_id)
        self.refresh_chat_list()

    def _prompt_messages(self, chat, path) -> list[PromptMessage]:
        messages = []
        system = (chat.settings or {}).get("system_prompt", "")
        if system:
            messages.append(PromptMessage("system", system))
        for m in path:
            if m.role == "assistant" and m.status == ERROR and not m.content:
                continue
            content = m.content
            if m.attachments:
                docs = [format_for_prompt(Document(name=a.name, path=Path(a.name), kind=a.kind,
                                                   text=a.text, size_bytes=a.size_bytes, pages=None))
                        for a in m.attachments]
                content = "\n\n".join(docs + ([content] if content else []))
            messages.append(PromptMessage(m.role, content))
        return messages

    def _sampling_params(self, chat) -> SamplingParams:
        values = self._default_chat_settings()
        values.update({k: v for k, v in (chat.settings or {}).items() if k in SAMPLING_KEYS})
        try:
            return SamplingParams(**{k: values[k] for k in SAMPLING_KEYS})
        except (ValueError, TypeError):
            return SamplingParams(**DEFAULT_SAMPLING)

    def stop(self) -> None:
        if self.current_chat_id is None:
            return
        reply = self.replies.for_chat(self.current_chat_id)
        if reply:
            self.bridge.abort(reply.request_id)
            self.window.statusBar().showMessage("Stopping…", 2000)

    def regenerate(self, message_id: int) -> None:
        message = self.store.get_message(message_id)
        if self.replies.for_chat(message.chat_id) or self.model_info is None:
            self._update_send_state()
            self.window.statusBar().showMessage("Wait for the model and the current reply.", 5000)
            return
        reply = self.store.add_version(message_id, "", status="streaming")
        self._start_reply(message.chat_id, reply.id)

    def edit_and_resend(self, message_id: int, text: str) -> None:
        message = self.store.get_message(message_id)
        if self.replies.for_chat(message.chat_id) or self.model_info is None:
            self.window.statusBar().showMessage("Wait for the model and the current reply.", 5000)
            return
        attachments = [NewAttachment(a.name, a.kind, a.text, a.token_count, a.size_bytes)
                       for a in message.attachments]
        with self.store.transaction():
            self.store.add_version(message_id, text.strip(), attachments=attachments)
            reply = self.store.add_message(message.chat_id, "assistant", "", status="streaming")
        self._start_reply(message.chat_id, reply.id)

    def switch_version(self, message_id: int, delta: int) -> None:
        versions = self.store.versions(message_id)
        target = versions.index + delta
        if 0 <= target < versions.count:
            message = self.store.get_message(message_id)
            self.store.switch_version(versions.messages[target].id)
            self.show_chat(message.chat_id)

    # ---- engine events -----------------------------------------------------------------

    def _on_engine_event(self, event) -> None:
        reply = self.replies.get(event.request_id)
        if reply is None:
            return
        if isinstance(event, Queued):
            reply.state = QUEUED
        elif isinstance(event, PrefillProgress):
            reply.state, reply.done, reply.total, reply.cached = (
                PREFILLING, event.done, event.total, event.cached)
            if self.model_info:
                self._last_usage[reply.chat_id] = (event.total, event.cached,
                                                   self.model_info.context_length)
                if reply.chat_id == self.current_chat_id:
                    self._update_context_meter()
            self._refresh_chat_item(reply.chat_id)
        elif isinstance(event, Token):
            if reply.state != STREAMING:
                reply.state = STREAMING
                reply.first_token_at = time.monotonic()
                self._refresh_chat_item(reply.chat_id)
            reply.tokens += 1
            reply.text += event.text
        elif isinstance(event, Finished):
            self._finish(reply, event)
            return
        elif isinstance(event, Failed):
            self._fail(reply, event.message)
            return
        self._refresh_message(reply)

    def _save_streams(self) -> None:
        for reply in self.replies.all():
            if reply.due_for_save():
                try:
                    self.store.update_message(reply.message_id, content=reply.text)
                    reply.mark_saved()
                except StorageError as exc:
                    self.window.statusBar().showMessage(str(exc), 8000)
            if reply.chat_id == self.current_chat_id and reply.state == STREAMING:
                self.window.speed_label.setText(f"{reply.tokens_per_second():.1f} tok/s")

    def _finish(self, reply: ActiveReply, event: Finished) -> None:
        self.replies.pop(reply.request_id)
        usage, timings = event.usage, event.timings
        status = STOPPED if event.finish_reason == "abort" else COMPLETE
        metadata = {"model": self.model_info.name if self.model_info else "",
                    "finish_reason": event.finish_reason,
                    "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "tokens_per_s": round(timings.decode_tokens_per_s, 1),
                    "time_to_first_token_s": round(timings.time_to_first_token_s, 3)}
        self._save_final(reply, event.text, status, None, metadata)
        if self.model_info:
            self._last_usage[reply.chat_id] = (usage.prompt_tokens + usage.completion_tokens,
                                               usage.cached_tokens, self.model_info.context_length)
        if reply.chat_id == self.current_chat_id:
            self.window.speed_label.setText(f"{timings.decode_tokens_per_s:.1f} tok/s")
        self._after_reply(reply)

    def _fail(self, reply: ActiveReply, message: str) -> None:
        self.replies.pop(reply.request_id)
        self._save_final(reply, reply.text, ERROR, message, {})
        self._after_reply(reply)

    def _save_final(self, reply: ActiveReply, text: str, status: str, error: str | None,
                    metadata: dict) -> None:
        try:
            self.store.update_message(reply.message_id, content=text, status=status,
                                      error=error, metadata=metadata)
        except StorageError as exc:
            self._alert("Could not save the reply", str(exc))

    def _after_reply(self, reply: ActiveReply) -> None:
        self._refresh_chat_item(reply.chat_id)
        if reply.chat_id == self.current_chat_id:
            self.window.message_view.update_message(
                self._item_for(self.store.get_message(reply.message_id)))
            self._update_send_state()
            self._update_context_meter()

    def _on_submit_failed(self, request_id: str, message: str) -> None:
        reply = self.replies.get(request_id)
        if reply:
            self._fail(reply, message)

    def _on_context_overflow(self, request_id: str, prompt_tokens: int, context: int) -> None:
        """Never truncate silently: say how far over it is and let the person choose."""
        reply = self.replies.get(request_id)
        if reply is None:
            return
        over = prompt_tokens - context
        room = min(self._sampling_params(self.store.get_chat(reply.chat_id)).max_tokens, 1024)
        message = (f"This conversation is {prompt_tokens:,} tokens but the model holds "
                   f"{context:,}{f' ({over:,} over)' if over > 0 else ''}, leaving no room for "
                   "a reply.")
        self._fail(reply, message)
        user = self.store.get_message(self.store.get_message(reply.message_id).parent_id)
        if user.attachments and self._confirm(
                "The documents do not fit",
                f"{message}\n\nShorten the attached documents to fit? The end of the longest "
                f"one is cut ({over + room:,} tokens), and the cut is marked. Your original "
                "message stays available as an earlier version."):
            self._shorten_and_resend(user, over + room)
        elif not user.attachments:
            self._alert("The conversation is too long", message + " Edit an earlier message or "
                        "start a new chat.")

    def _shorten_and_resend(self, user, cut_tokens: int) -> None:
        """A new version of `user` whose attachments lose `cut_tokens`, longest first."""
        attachments = sorted(user.attachments, key=lambda a: a.token_count, reverse=True)
        shortened = []
        for a in attachments:
            text, tokens = a.text, a.token_count
            if cut_tokens > 0 and tokens > 0:
                take = min(tokens, cut_tokens)
                keep_chars = int(len(text) * (tokens - take) / tokens * 0.95)
                text = text[:keep_chars] + ("\n[… the rest of this document was cut to fit the "
                                            "model's context]" if keep_chars else "")
                cut_tokens -= take
                tokens -= take
            if text:
                shortened.append(NewAttachment(a.name, a.kind, text, tokens, a.size_bytes))
        order = {a.name: i for i, a in enumerate(user.attachments)}
        shortened.sort(key=lambda a: order.get(a.name, 0))
        with self.store.transaction():
            self.store.add_version(user.id, user.content, attachments=shortened)
            reply = self.store.add_message(user.chat_id, "assistant", "", status="streaming")
        self._start_reply(user.chat_id, reply.id)

    def _update_context_meter(self) -> None:
        meter = self.window.context_meter
        if self.model_info is None or self.current_chat_id is None:
            meter.setText("")
            return
        used, cached, context = self._last_usage.get(self.current_chat_id, (0, 0, self.model_info.context_length))
        pending = sum(max(c.tokens or 0, 0) for c in self._pending_for(self.current_chat_id))
        cached_text = f" · {cached:,} cached" if cached else ""
        meter.setText(f"{used + pending:,} / {context:,} tokens{cached_text}")

    # ---- documents ---------------------------------------------------------------------

    def _pending_for(self, chat_id: int | None) -> list[PendingAttachment]:
        return self.pending.get(chat_id, []) if chat_id is not None else []

    def _choose_documents(self) -> None:
        paths, _ = QtWidgets.QFileDialog.getOpenFileNames(
            self.window, "Attach documents", str(Path.home()),
            "Documents (*.txt *.md *.pdf *.docx *.csv *.json *.py *.js *.ts *.c *.cpp *.rs *.go "
            "*.java *.html *.css *.xml *.yaml *.yml *.toml);;All files (*)")
        if paths:
            self.add_files(paths)

    def add_files(self, paths: list[str]) -> None:
        models = [p for p in paths if p.lower().endswith(".gguf")]
        documents = [p for p in paths if not p.lower().endswith(".gguf")]
        for path in models:
            if self._confirm("Add a model?", f"{Path(path).name} is a model file. Add it to the "
                                             "model picker?"):
                self.bridge.inspect_model(path)
        if self.current_chat_id is None:
            return
        for path in documents:  # the worker reads each; a refusal comes back as a clear alert
            key = f"att{next(self._attachment_ids)}"
            self.pending.setdefault(self.current_chat_id, []).append(
                PendingAttachment(key, Path(path).name))
            self.bridge.read_document(key, path)
        self._show_attachments()

    def _find_pending(self, key: str) -> PendingAttachment | None:
        for chips in self.pending.values():
            for chip in chips:
                if chip.key == key:
                    return chip
        return None

    def _on_document_read(self, key: str, document: Document, tokens: int) -> None:
        chip = self._find_pending(key)
        if chip is None:
            return
        chip.document = document
        chip.tokens = tokens if tokens >= 0 else None
        self._show_attachments()

    def _on_document_failed(self, key: str, message: str) -> None:
        self._remove_attachment(key)
        self._alert("This file cannot be attached", message)

    def _remove_attachment(self, key: str) -> None:
        for chat_id, chips in self.pending.items():
            self.pending[chat_id] = [c for c in chips if c.key != key]
        self._show_attachments()

    def _show_attachments(self) -> None:
        chips = self._pending_for(self.current_chat_id)
        context = self.model_info.context_length if self.model_info else None
        used = self._last_usage.get(self.current_chat_id, (0, 0, 0))[0] if self.current_chat_id else 0
        total = used + sum(max(c.tokens or 0, 0) for c in chips)
        views = []
        for chip in chips:
            warning = ""
            if context and chip.tokens and total > context:
                warning = f"{total - context:,} tokens over the context"
            views.append(AttachmentChip(chip.key, chip.name, chip.tokens, warning))
        self.window.composer.set_attachments(views)
        self._update_context_meter()

    # ---- chat settings, preferences, import / export -----------------------------------

    def _open_chat_settings(self) -> None:
        from app.ui.settings_dialogs import ChatSettingsDialog

        if self.current_chat_id is None:
            return
        chat = self.store.get_chat(self.current_chat_id)
        values = self._default_chat_settings()
        values["system_prompt"] = ""
        values.update(chat.settings or {})
        dialog = ChatSettingsDialog(values, self.window)
        if dialog.exec():
            self.store.update_chat_settings(chat.id, dialog.values())
            if dialog.make_default():  # remembered for the current model
                self.save_model_defaults({k: v for k, v in dialog.values().items()
                                          if k in SAMPLING_KEYS})

    def _open_preferences(self) -> None:
        from app.ui.settings_dialogs import PreferencesDialog

        dialog = PreferencesDialog(self.engine_settings(), self.window)
        if dialog.exec():
            values = dialog.values()
            self.save_model_defaults({"context_size": values.pop("context_size")})
            self.store.set_setting("engine", values)
            if not self.replies or self._confirm("Reload the model?",
                                                 "Running replies will be stopped."):
                self.load_selected_model()

    def _export_chat(self, kind: str, chat_id: int | None = None) -> None:
        from app.storage import export_json, export_markdown

        chat_id = chat_id or self.current_chat_id
        if chat_id is None:
            return
        chat = self.store.get_chat(chat_id)
        suffix = ".md" if kind == "md" else ".json"
        safe = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in chat.title)[:60]
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self.window, "Export chat",
                                                        str(Path.home() / f"{safe}{suffix}"))
        if not path:
            return
        import json

        try:
            text = (export_markdown(self.store, chat_id) if kind == "md"
                    else json.dumps(export_json(self.store, chat_id), indent=2, ensure_ascii=False))
            Path(path).write_text(text, encoding="utf-8")
        except (OSError, StorageError) as exc:
            self._alert("Export failed", str(exc))
            return
        self.window.statusBar().showMessage(f"Exported to {path}", 6000)

    def _import_chat(self) -> None:
        import json

        from app.storage import import_json

        path, _ = QtWidgets.QFileDialog.getOpenFileName(self.window, "Import a chat",
                                                        str(Path.home()), "Chat JSON (*.json)")
        if not path:
            return
        try:
            chat = import_json(self.store, json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError, StorageError) as exc:
            self._alert("Import failed", f"{Path(path).name}: {exc}")
            return
        self.current_chat_id = chat.id
        self.refresh_chat_list()
        self.show_chat(chat.id)

    # ---- helpers and shutdown ----------------------------------------------------------

    def _alert(self, title: str, text: str) -> None:
        """Tell the person something went wrong (the one place; tests replace it)."""
        self.alerts.append((title, text))
        QtWidgets.QMessageBox.warning(self.window, title, text)

    def _confirm(self, title: str, text: str) -> bool:
        """Ask yes/no (the one place; tests replace it)."""
        answer = QtWidgets.QMessageBox.question(self.window, title, text)
        return answer == QtWidgets.QMessageBox.StandardButton.Yes

    def shutdown(self) -> None:
        """Save what is streaming, stop the engine, close the store."""
        self._save_timer.stop()
        for reply in self.replies.all():
            self.store.update_message(reply.message_id, content=reply.text, status=STOPPED)
        self.replies = ReplyBook()
        self.bridge.shutdown()
