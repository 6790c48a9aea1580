"""What the main window does: chats, sending, streaming, versions, documents, models.

Runs entirely on the GUI thread. It talks to the engine only through `EngineBridge`
(queued signals in, Qt signals out) and to the store directly (every store call is short).
Several chats may generate at once; switching chats never touches a stream, it only changes
which chat the message view shows.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
import time
from pathlib import Path

from app.engine.events import Failed, Finished, PrefillProgress, Queued, Token
from app.engine.sampling import SamplingParams
from app.storage import ChatStore, NewAttachment, StorageError
from app.ui.bridge import EngineBridge
from app.storage.connections import ConnectionStore
from app.ui.chat_list import ChatList
from app.ui.connections_dialog import ConnectionsDialog
from app.ui.defaults import DEFAULT_SAMPLING, SAMPLING_KEYS
from app.ui.dialog_actions import DialogActions
from app.paths import models_dir
from app.ui.document_actions import SEARCHED, DocumentActions, PendingAttachment
from app.ui.document_plan import (PASSAGES_KEY, chat_mode, cited_passages, is_searched,
                                  passages_that_fit, passages_to_metadata, prompt_messages,
                                  search_question, searched_sources)
from app.ui.retrieval_worker import RetrievalWorker
from app.ui.main_window import MainWindow
from app.ui.model_actions import ModelActions
from app.ui.remote_models import route
from app.ui.qt import QObject, Qt, QTimer, QtWidgets
from app.ui.reasoning_view import split_reply
from app.ui.replies import SAVE_INTERVAL_MS, ActiveReply, ReplyBook
from app.ui.title_actions import TitleActions
from app.ui.titles import fallback_title
from app.ui.trash_actions import TrashActions
from app.ui.trash_dialog import TrashDialog
from app.ui.view_models import (
    COMPLETE,
    ERROR,
    PREFILLING,
    QUEUED,
    STOPPED,
    STREAMING,
    MessageItem,
)


class ChatController(QObject, ModelActions, DocumentActions, DialogActions, TrashActions,
                     TitleActions):
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
        self._restored: dict[int, int] = {}  # chat -> of its cached tokens, read from disk
        self._continued_usage: dict[int, dict] = {}  # message -> its metadata before Continue
        self._title_jobs: dict[str, tuple[int, str]] = {}  # request id -> chat id, title so far
        self._auto_titles: dict[int, str] = {}  # chat -> the title given automatically
        self.trash_dialog: TrashDialog | None = None
        # Remote servers, in the same database file (API keys in the keychain).
        self.connections = ConnectionStore(store.path)
        self.connections_dialog: ConnectionsDialog | None = None
        # What the engine offers here; the worker answers at start-up.
        self.devices: tuple[str, ...] = ("auto",)
        self.dtypes: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
        self._search_timer = QTimer(singleShot=True, interval=200)
        self._undo_timer = QTimer(singleShot=True, interval=8000)
        # Streaming replies reach the disk on this beat, whenever their text changed.
        self._save_timer = QTimer(interval=SAVE_INTERVAL_MS)
        # Indexing and searching documents: its own thread (app/ui/retrieval_worker.py).
        self.documents = RetrievalWorker(data_dir, models_dir(data_dir))
        self._init_model_state()
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
        w.composer.indexCancelRequested.connect(self._cancel_indexing)
        w.composer.filesDropped.connect(self.add_files)
        w.filesDropped.connect(self.add_files)
        w.message_view.regenerateRequested.connect(self.regenerate)
        w.message_view.editRequested.connect(self.edit_and_resend)
        w.message_view.versionRequested.connect(self.switch_version)
        w.message_view.continueRequested.connect(self.continue_reply)
        w.message_view.copied.connect(lambda _: w.statusBar().showMessage("Copied", 2000))
        w.model_picker.activated.connect(self._on_model_picked)
        w.add_model_action.triggered.connect(self._choose_model_file)
        w.add_model_folder_action.triggered.connect(self._choose_model_folder)
        w.trash_action.triggered.connect(self.open_trash)
        w.remove_model_action.triggered.connect(self.remove_current_model)
        w.settings_action.triggered.connect(self._open_preferences)
        w.connections_action.triggered.connect(self.open_connections)
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
        b.modelKept.connect(self._on_model_kept)
        b.chatCounted.connect(self._on_chat_counted)
        b.devicesFound.connect(self._on_devices_found)
        b.embeddedReady.connect(self._on_embedded_ready)
        b.embeddedProgress.connect(self._on_embedded_progress)
        b.event.connect(self._on_engine_event)
        b.submitFailed.connect(self._on_submit_failed)
        b.contextOverflow.connect(self._on_context_overflow)
        b.documentRead.connect(self._on_document_read)
        b.tokensCounted.connect(self._on_tokens_counted)
        b.documentFailed.connect(self._on_document_failed)
        b.modelInspected.connect(self._on_model_inspected)
        b.modelRejected.connect(self._on_model_rejected)
        d = self.documents
        d.indexProgress.connect(self._on_index_progress)
        d.indexed.connect(self._on_indexed)
        d.indexFailed.connect(self._on_index_failed)
        d.indexCancelled.connect(self._on_index_cancelled)
        d.retrieved.connect(self._on_retrieved)
        d.retrieveFailed.connect(self._on_retrieve_failed)

    def start(self) -> None:
        """Show the chats and start loading the model (in the worker)."""
        self.store.mark_interrupted()
        self.bridge.probe_devices()
        self.refresh_models()
        self.refresh_chat_list()
        if self.window.chat_list.count():
            self.window.chat_list.setCurrentRow(0)
        else:
            self.new_chat()
        self._update_send_state()
        self.load_selected_model()

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
            item = QtWidgets.QListWidgetItem()
            ChatList.fill_item(item, chat, self._chat_badge(chat.id))
            chat_list.addItem(item)
            if chat.id == self.current_chat_id:
                chat_list.setCurrentItem(item)
        chat_list.blockSignals(False)
        self._update_trash_button()

    def _chat_badge(self, chat_id: int) -> str:
        reply = self.replies.for_chat(chat_id)
        return reply.list_badge() if reply else ""

    def _refresh_chat_item(self, chat_id: int) -> None:
        item = self.window.chat_list.item_for(chat_id)
        if item is not None:
            ChatList.fill_item(item, self.store.get_chat(chat_id), self._chat_badge(chat_id))

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

    def rename_chat(self, chat_id: int, title: str | None = None, automatic: bool = False) -> None:
        if title is None:
            title, ok = QtWidgets.QInputDialog.getText(self.window, "Rename chat", "Title:",
                                                       text=self.store.get_chat(chat_id).title)
            if not ok:
                return
        if title.strip():
            self.store.rename_chat(chat_id, title.strip())
            if not automatic:
                self._auto_titles.pop(chat_id, None)  # the person's title stays
            self._refresh_chat_item(chat_id)
            if chat_id == self.current_chat_id:
                self.window.chat_title.setText(title.strip())

    def pin_chat(self, chat_id: int, pinned: bool) -> None:
        self.store.set_pinned(chat_id, pinned)
        self.refresh_chat_list()

    def delete_chat(self, chat_id: int) -> None:
        reply = self.replies.for_chat(chat_id)
        if reply and (reply.held or reply.searching):
            self._cancel_held(reply)
        elif reply:
            self.bridge.abort(reply.request_id)
        chat = self.store.delete_chat(chat_id)
        self._deleted_chat_id = chat_id
        self.window.statusBar().showMessage(f"“{chat.title[:40]}” moved to the Trash", 8000)
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
        for reply in self.replies.all():  # items are rebuilt for the chat now shown
            reply.view_item = None
        chat = self.store.get_chat(chat_id)
        self.window.chat_title.setText(chat.title)
        items = [self._item_for(m) for m in self.store.active_path(chat_id)]
        view = self.window.message_view
        view.set_messages(items)
        if not items:
            view.set_placeholder("Start the conversation below. Drop documents to ask about them.")
        self._show_attachments()
        self._update_send_state()
        self._show_speed(chat_id, items)
        if chat_id not in self._last_usage:
            self._count_chat(chat_id)
        self._update_context_meter()

    def _show_speed(self, chat_id: int, items: list[MessageItem]) -> None:
        """The tok/s of this chat's last reply; nothing for a chat without one."""
        reply = self.replies.for_chat(chat_id)
        if reply is not None and reply.state == STREAMING:
            text = f"{reply.tokens_per_second():.1f} tok/s"
        else:
            last = next((self.store.get_message(i.message_id) for i in reversed(items)
                         if i.role == "assistant"), None)
            speed = (last.metadata or {}).get("tokens_per_s") if last else None
            text = f"{speed:.1f} tok/s" if speed else ""
        self.window.speed_label.setText(text)

    def _count_chat(self, chat_id: int) -> None:
        """Ask the worker how many tokens this chat's conversation takes (the meter after a
        relaunch, before any reply of this session)."""
        if self.model_info is None:
            return
        path = self.store.active_path(chat_id)
        if path:
            self.bridge.count_chat(chat_id, self._prompt_messages(self.store.get_chat(chat_id), path))

    def _prompt_messages(self, chat, path, leave_out: int | None = None):
        """The conversation as the model reads it (app/ui/document_plan.prompt_messages)."""
        settings = chat.settings or {}
        return prompt_messages(settings.get("system_prompt", ""), path, chat_mode(settings), leave_out)

    def _on_chat_counted(self, chat_id: int, tokens: int) -> None:
        if self.model_info is None or chat_id in self._last_usage:
            return  # a reply's own figures arrived first: they are newer
        self._last_usage[chat_id] = (tokens, 0, self.model_info.context_length)
        if chat_id == self.current_chat_id:
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
            if meta.get("restored_tokens"):
                info += f" (restored {meta['restored_tokens']:,} tokens from disk)"
        cut = (message.role == "assistant" and not live and status == COMPLETE
               and meta.get("finish_reason") == "length")
        mode = chat_mode(self.store.get_chat(message.chat_id).settings) if message.attachments else ""
        names = tuple(f"{a.name} (searched)" if is_searched(a, mode) else a.name
                      for a in message.attachments)
        item = MessageItem(
            message_id=message.id, role=message.role, text=text, status=status,
            version_index=versions.index, version_count=versions.count,
            attachments=names, info=info,
            error=message.error or "", progress=reply.progress_text() if live else "", cut=cut,
            passages=cited_passages(meta) if message.role == "assistant" else ())
        if message.role == "assistant":
            item = split_reply(item, reply.thinking_s if live else meta.get("thinking_s"))
        return item

    def _refresh_message(self, reply: ActiveReply) -> None:
        """Show a live reply's progress. Called per token: the store is read once per reply
        and view, then only the live fields change."""
        if reply.chat_id != self.current_chat_id:
            return
        base = reply.view_item
        if base is None or base.message_id != reply.message_id:
            base = reply.view_item = self._item_for(self.store.get_message(reply.message_id))
        self.window.message_view.update_message(split_reply(replace(
            base, text=reply.text, status=reply.state, progress=reply.progress_text()),
            reply.thinking_s))

    # ---- sending -----------------------------------------------------------------------

    def _update_send_state(self) -> None:
        composer = self.window.composer
        busy = self.current_chat_id is not None and self.replies.for_chat(self.current_chat_id) is not None
        composer.set_busy(busy)
        # Send stays clickable without a model: while one loads the message waits for it;
        # after a failure pressing Send explains why nothing was sent, and the text is kept.
        if self.model_info is None and self.model_error:
            composer.set_send_enabled(True, f"No model is loaded. {self.model_error}")
        elif self.model_info is None:
            composer.set_send_enabled(True, "The model is loading: your message will wait "
                                            "for it and be sent when it is ready")
        else:
            composer.set_send_enabled(True)

    def send(self, text: str) -> None:
        chat_id = self.current_chat_id
        if chat_id is None:
            return
        if self.model_info is None and self.model_error:
            self.window.statusBar().showMessage(
                f"No model is loaded, so nothing was sent. {self.model_error}", 8000)
            return
        if self.replies.for_chat(chat_id):
            self.window.statusBar().showMessage("This chat is still answering; stop it first.", 5000)
            return
        chips = self._pending_for(chat_id)
        if any(c.document is None for c in chips):
            self.window.statusBar().showMessage("Wait until the attachments are read.", 5000)
            return
        if any(not c.goes_whole and c.index != SEARCHED for c in chips):
            self.window.statusBar().showMessage(
                "Wait until the documents are indexed for search (or cancel indexing to send "
                "them whole).", 6000)
            return
        if not text.strip() and not chips:
            return
        attachments = [NewAttachment(name=c.name, kind=c.document.kind, text=c.document.text,
                                     token_count=max(c.tokens or 0, 0),
                                     size_bytes=c.document.size_bytes,
                                     sha256=c.sha256 if c.index == SEARCHED else None)
                       for c in chips]
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
        held = self.model_info is None
        self._start_reply(chat_id, reply.id, held=held)
        if held:
            self.window.statusBar().showMessage(
                "The model is still loading: your message is queued and will be sent when "
                "it is ready.", 8000)

    def _maybe_title(self, chat_id: int, text: str, chips: list[PendingAttachment]) -> None:
        chat = self.store.get_chat(chat_id)
        if chat.title == "New chat":
            title = fallback_title(text, [c.name for c in chips])
            self.store.rename_chat(chat_id, title)
            self._auto_titles[chat_id] = self.store.get_chat(chat_id).title

    def _start_reply(self, chat_id: int, reply_id: int, held: bool = False,
                     prefix: str = "") -> None:
        """Start the reply `reply_id` (empty and streaming, or `prefix` to carry on): submit
        the conversation before it now, or once the model is ready when `held`."""
        request_id = f"chat{chat_id}-{next(self._request_ids)}"
        reply = ActiveReply(request_id, chat_id, reply_id, text=prefix, held=held, prefix=prefix)
        self.replies.add(reply)
        if not held:
            self._submit(reply)
        path = self.store.active_path(chat_id)
        if chat_id == self.current_chat_id:
            self._show_new_messages(chat_id, path)
        self.refresh_chat_list()

    def _submit(self, reply: ActiveReply) -> None:
        path = self.store.active_path(reply.chat_id)
        chat = self.store.get_chat(reply.chat_id)
        if self._search_first(reply, chat, path):
            return
        messages = self._prompt_messages(chat, path, leave_out=reply.message_id)
        reply.started_at = time.monotonic()
        if reply.prefix:
            self.bridge.continue_reply(reply.request_id, messages, reply.prefix,
                                       self._sampling_params(chat), cache_owner=str(chat.id))
        else:
            self.bridge.submit(reply.request_id, messages, self._sampling_params(chat),
                               cache_owner=str(chat.id))

    def _search_first(self, reply: ActiveReply, chat, path) -> bool:
        """A chat with searched documents: a new reply first asks the document worker for
        the question's passages (then `_on_retrieved` submits). False when there is nothing
        to search or the reply already has its passages (a Continue, a retry)."""
        index = next((i for i, m in enumerate(path) if m.id == reply.message_id), None)
        sources = searched_sources(path, chat_mode(chat.settings))
        if (not sources or reply.prefix or index is None or index == 0
                or PASSAGES_KEY in (path[index].metadata or {})):
            return False
        reply.searching = True
        context = self.model_info.context_length if self.model_info else 0
        used = self._last_usage.get(chat.id, (0, 0, 0))[0]
        k = passages_that_fit(context, used, self._reply_room(chat.id)) if context else 1
        self.documents.retrieve(reply.request_id, search_question(path[index - 1]), sources, k)
        return True

    def _on_retrieved(self, request_id: str, retrieved) -> None:
        """The question's passages: saved with the reply (reopening the chat shows them),
        then the prompt that numbers them is submitted."""
        reply = self.replies.get(request_id)
        if reply is None or not reply.searching:
            return  # stopped while searching
        reply.searching = False
        try:
            self.store.update_message(reply.message_id,
                                      metadata={PASSAGES_KEY: passages_to_metadata(retrieved)})
        except StorageError as exc:
            self._fail(reply, str(exc))
            return
        reply.view_item = None  # the stored item now has its sources
        self._submit(reply)
        self._refresh_message(reply)
        self._refresh_chat_item(reply.chat_id)  # the list's badge: no longer "searching"

    def _on_retrieve_failed(self, request_id: str, message: str) -> None:
        reply = self.replies.get(request_id)
        if reply is not None and reply.searching:
            reply.searching = False
            self._fail(reply, message)

    def _submit_held(self) -> None:
        """The model is ready: send what waited for it."""
        held = [r for r in self.replies.all() if r.held]
        for reply in held:
            reply.held = False
            self._submit(reply)
            self._refresh_message(reply)
            self._refresh_chat_item(reply.chat_id)
        if held:
            self.window.statusBar().showMessage(
                f"The model is ready: sending your queued message{'s' * (len(held) > 1)}.", 8000)

    def _fail_held(self, message: str) -> None:
        """The model could not be loaded: what waited for it fails with the reason (the
        question stays; Regenerate sends it once a model is loaded)."""
        for reply in [r for r in self.replies.all() if r.held]:
            self._fail(reply, f"Not sent: the model could not be loaded. {message}")

    def _cancel_held(self, reply: ActiveReply) -> None:
        """Stop a reply that never reached the engine (it waited for the model)."""
        self.replies.pop(reply.request_id)
        self._save_final(reply, reply.text, STOPPED, None, {})
        self._after_reply(reply)

    def continue_reply(self, message_id: int) -> None:
        """Carry on a reply cut by the token limit: the same message grows, no new turn."""
        message = self.store.get_message(message_id)
        if self.replies.for_chat(message.chat_id) or self.model_info is None:
            self.window.statusBar().showMessage("Wait for the model and the current reply.", 5000)
            return
        self._continued_usage[message_id] = dict(message.metadata or {})
        self.store.update_message(message_id, status="streaming")
        self._start_reply(message.chat_id, message_id, prefix=message.content)

    def _show_new_messages(self, chat_id: int, path) -> None:
        """Append what the view lacks when it already shows the path's beginning (a send):
        rebuilding every message widget would stall the GUI in a long chat. A changed
        branch (regenerate, edit) is shown anew."""
        view = self.window.message_view
        shown = view.message_ids()
        if [m.id for m in path[:len(shown)]] != shown:
            self.show_chat(chat_id)
            return
        self.window.chat_title.setText(self.store.get_chat(chat_id).title)
        for message in path[len(shown):]:
            view.update_message(self._item_for(message))
        self._show_attachments()
        self._update_send_state()
        self._update_context_meter()

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
        if reply and (reply.held or reply.searching):
            self._cancel_held(reply)
        elif reply:
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
        attachments = [NewAttachment(a.name, a.kind, a.text, a.token_count, a.size_bytes, a.sha256)
                       for a in message.attachments]
        with self.store.transaction():
            self.store.add_version(message_id, text.strip(), attachments=attachments)
            reply = self.store.add_message(message.chat_id, "assistant", "", status="streaming")
        self._start_reply(message.chat_id, reply.id)
        self.window.composer.focus_input()  # the editor is gone; the next message goes here

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
            if event.request_id in self._title_jobs:
                self._on_title_event(event)
            return
        if isinstance(event, Queued):
            reply.state, reply.total = QUEUED, event.prompt_tokens
            self._refresh_chat_item(reply.chat_id)
        elif isinstance(event, PrefillProgress):
            reply.state, reply.done, reply.total, reply.cached, reply.restored = (
                PREFILLING, event.done, event.total, event.cached, event.restored)
            if self.model_info:
                self._restored[reply.chat_id] = event.restored
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
            reply.note_reasoning(time.monotonic())
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
            if reply.state == STREAMING and self.model_info:
                # The conversation holds the prompt and the reply so far.
                self._last_usage[reply.chat_id] = (reply.total + reply.tokens, reply.cached,
                                                   self.model_info.context_length)
            if reply.chat_id == self.current_chat_id and reply.state == STREAMING:
                self.window.speed_label.setText(f"{reply.tokens_per_second():.1f} tok/s")
                self._update_context_meter()

    def _finish(self, reply: ActiveReply, event: Finished) -> None:
        self.replies.pop(reply.request_id)
        usage, timings = event.usage, event.timings
        status = STOPPED if event.finish_reason == "abort" else COMPLETE
        earlier = self._continued_usage.pop(reply.message_id, {}) if reply.prefix else {}
        metadata = {"model": self.model_info.name if self.model_info else "",
                    "finish_reason": event.finish_reason,
                    "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                    "restored_tokens": usage.restored_tokens,
                    "completion_tokens": usage.completion_tokens + earlier.get("completion_tokens", 0),
                    "tokens_per_s": round(timings.decode_tokens_per_s, 1),
                    "time_to_first_token_s": round(timings.time_to_first_token_s, 3)}
        if reply.thinking_s is not None or earlier.get("thinking_s") is not None:
            metadata["thinking_s"] = round(reply.thinking_s or earlier.get("thinking_s") or 0, 1)
        self._save_final(reply, reply.prefix + event.text, status, None, metadata)
        if self.model_info:
            self._restored[reply.chat_id] = usage.restored_tokens
            self._last_usage[reply.chat_id] = (usage.prompt_tokens + usage.completion_tokens,
                                               usage.cached_tokens, self.model_info.context_length)
        if reply.chat_id == self.current_chat_id:
            self.window.speed_label.setText(f"{timings.decode_tokens_per_s:.1f} tok/s")
            if usage.restored_tokens:  # why this follow-up started quickly after a restart
                self.window.statusBar().showMessage(
                    f"Restored {usage.restored_tokens:,} tokens of this conversation from "
                    "the disk cache instead of reading them again.", 10000)
        self._after_reply(reply)
        if status == COMPLETE:
            self._maybe_ask_for_title(reply.chat_id)

    def _fail(self, reply: ActiveReply, message: str) -> None:
        self.replies.pop(reply.request_id)
        if reply.prefix:  # a Continue that failed: the reply stays as it was, cut
            self._save_final(reply, reply.text, COMPLETE, None,
                             self._continued_usage.pop(reply.message_id, {}))
            self._after_reply(reply)
            self._alert("Could not continue the reply", message)
            return
        self._save_final(reply, reply.text, ERROR, message, {})
        self._after_reply(reply)

    def _save_final(self, reply: ActiveReply, text: str, status: str, error: str | None,
                    metadata: dict) -> None:
        try:
            kept = (self.store.get_message(reply.message_id).metadata or {}).get(PASSAGES_KEY)
            if kept is not None and PASSAGES_KEY not in metadata:  # the passages stay with it
                metadata = {**metadata, PASSAGES_KEY: kept}
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

    def _update_context_meter(self) -> None:
        meter = self.window.context_meter
        if self.model_info is None or self.current_chat_id is None:
            meter.setText("")
            return
        used, cached, context = self._last_usage.get(self.current_chat_id, (0, 0, self.model_info.context_length))
        pending = sum(max(c.tokens or 0, 0) for c in self._pending_for(self.current_chat_id)
                      if c.goes_whole)
        cached_text = f" · {cached:,} cached" if cached else ""
        restored = self._restored.get(self.current_chat_id, 0) if cached else 0
        if restored:
            cached_text += f" ({restored:,} from disk)"
        meter.setText(f"{used + pending:,} / {context:,} tokens{cached_text}")

    # ---- helpers and shutdown ----------------------------------------------------------

    def open_connections(self) -> None:
        """Settings → Connections…: not modal; the picker follows its changes."""
        if self.connections_dialog is None:
            self.connections_dialog = ConnectionsDialog(self.connections, self.store, self.window)
            self.connections_dialog.changed.connect(self._on_connections_changed)
            self.connections_dialog.saved.connect(self._on_connection_saved)
        self.connections_dialog.show()
        self.connections_dialog.raise_()

    def _on_connection_saved(self, connection_id: int) -> None:
        """The loaded remote model's connection changed (URL, key, header): the next replies
        use the new settings. A running reply finishes on the old ones first."""
        loaded = route(self._loaded_key)
        if loaded.kind != "remote" or loaded.connection_id != connection_id:
            return
        if self.replies:
            self.window.statusBar().showMessage(
                "The connection's new settings apply once the running replies end and the "
                "model is picked again.", 8000)
            return
        self.load_selected_model()

    def _on_connections_changed(self) -> None:
        """The picker is rebuilt, keeping what it shows (unless that connection is gone)."""
        picker = self.window.model_picker
        shown = picker.currentData()
        self.refresh_models()
        index = picker.findData(shown)
        if index >= 0:
            picker.setCurrentIndex(index)
        elif shown is not None and shown == self._loaded_key:  # its connection was removed
            self.load_selected_model()

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
            if reply.held:  # never sent: the question stays, the empty reply says why
                self.store.update_message(reply.message_id, status=ERROR,
                                          error="Not sent: the app closed before the model was ready.")
                continue
            self.store.update_message(reply.message_id, content=reply.text,
                                      status=COMPLETE if reply.prefix and not reply.tokens else STOPPED)
        self.replies = ReplyBook()
        self.documents.shutdown()
        self.bridge.shutdown()
        self.connections.close()
