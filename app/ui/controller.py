"""What the main window does: chats, sending, streaming, versions, documents, models.

Runs entirely on the GUI thread. What a reply is -- its prompt, its lifecycle, what is saved
and when, the context budget -- is the chat service's (app/chat/service.py, no Qt); this
module wires it to the widgets: the bridge's events go to `ChatService.apply` and the
outcome is shown. It talks to the engine only through `EngineBridge` (queued signals in, Qt
signals out) and to the store directly (every store call is short). Several chats may
generate at once; switching chats never touches a stream, it only changes which chat the
message view shows (and, when that chat was answered by another model, the picker's model).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

from app.chat.metadata import can_continue, is_cut
from app.chat.prompt import chat_messages
from app.chat.service import ChatService
from app.engine.events import PrefillProgress, Queued, Token
from app.engine.sampling import SamplingParams
from app.storage import ChatStore, NewAttachment, StorageError
from app.ui.bridge import EngineBridge
from app.storage.connections import ConnectionStore
from app.ui.chat_list import ChatList
from app.ui.connections_dialog import ConnectionsDialog
from app.ui.defaults import DEFAULT_SAMPLING, SAMPLING_KEYS
from app.ui.api_server_actions import ApiServerActions
from app.ui.dialog_actions import DialogActions
from app.paths import models_dir
from app.ui.document_actions import SEARCHED, DocumentActions, PendingAttachment
from app.ui.document_plan import chat_mode, cited_passages, is_searched
from app.ui.retrieval_worker import RetrievalWorker
from app.ui.main_window import MainWindow
from app.ui.model_actions import ModelActions
from app.ui.remote_models import route
from app.ui.qt import QObject, Qt, QTimer, QtWidgets
from app.ui.reasoning_view import split_reply
from app.ui.replies import ActiveReply
from app.ui.reply_wiring import ReplyWiring
from app.ui.title_actions import TitleActions
from app.ui.titles import fallback_title
from app.ui.trash_actions import TrashActions
from app.ui.trash_dialog import TrashDialog
from app.ui.view_models import COMPLETE, ERROR, STREAMING, MessageItem

COUNT_DELAY_MS = 400  # after a chat is opened, before its tokens are counted for the meter


class ChatController(QObject, ModelActions, DocumentActions, DialogActions, TrashActions,
                     TitleActions, ApiServerActions):
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
        # The replies' lifecycle; requests go to the bridge's worker (looked up at each call,
        # so a test may wrap bridge.submit).
        self.chat = ChatService(store, lambda r: self.bridge.submit_request(r),
                                lambda request_id: self.bridge.abort(request_id),
                                self._sampling_params)
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
        self._title_jobs: dict[str, tuple[int, str]] = {}  # request id -> chat id, title so far
        self._auto_titles: dict[int, str] = {}  # chat -> the title given automatically
        self.trash_dialog: TrashDialog | None = None
        self.api_url = ""  # the local API server's address while it serves
        # Remote servers, in the same database file (API keys in the keychain).
        self.connections = ConnectionStore(store.path)
        self.connections_dialog: ConnectionsDialog | None = None
        # What the engine offers here; the worker answers at start-up.
        self.devices: tuple[str, ...] = ("auto",)
        self.dtypes: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
        self._search_timer = QTimer(singleShot=True, interval=200)
        self._undo_timer = QTimer(singleShot=True, interval=8000)
        # Indexing and searching documents: its own thread (app/ui/retrieval_worker.py).
        self.documents = RetrievalWorker(data_dir, models_dir(data_dir))
        self._init_model_state()
        self._connect()

    @property
    def replies(self):
        """The replies in progress (the chat service's ReplyBook)."""
        return self.chat.replies

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
        w.api_server_action.triggered.connect(self._open_api_server)
        w.api_status.clicked.connect(self._open_api_server)
        b.apiServerChanged.connect(self._on_api_server_changed)
        w.chat_settings_action.triggered.connect(self._open_chat_settings)
        w.import_action.triggered.connect(self._import_chat)
        w.export_md_action.triggered.connect(lambda: self._export_chat("md"))
        w.export_json_action.triggered.connect(lambda: self._export_chat("json"))
        w.undo_button.clicked.connect(self.undo_delete)
        self._undo_timer.timeout.connect(self._forget_undo)
        w.closing.connect(self.shutdown)
        b.modelLoading.connect(self._on_model_loading)
        b.modelLoaded.connect(self._on_model_loaded)
        b.modelFailed.connect(self._on_model_failed)
        b.modelKept.connect(self._on_model_kept)
        b.policySettled.connect(self._on_policy_settled)
        b.chatCounted.connect(self._on_chat_counted)
        b.devicesFound.connect(self._on_devices_found)
        b.embeddedReady.connect(self._on_embedded_ready)
        b.embeddedProgress.connect(self._on_embedded_progress)
        # Backend events reach the chat service through one small QObject (reply_wiring.py),
        # which also saves streaming replies on its beat; here they are shown.
        self.wiring = ReplyWiring(self.chat, b, self)
        self.wiring.changed.connect(self._on_reply_changed)
        self.wiring.ended.connect(self._after_end)
        self.wiring.unclaimed.connect(self._on_unclaimed_event)
        self.wiring.ticked.connect(self._show_streaming)
        self.wiring.saveFailed.connect(lambda error: self.window.statusBar().showMessage(error, 8000))
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
        self._starting = True  # the first chat shown sets the picker; it is loaded below
        if self.window.chat_list.count():
            self.window.chat_list.setCurrentRow(0)
        else:
            self.new_chat()
        self._starting = False
        self._update_send_state()
        self._start_saved_api_server()  # (queued before the load: a busy port shows at once)
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
        stopped = self.chat.stop(chat_id)
        if stopped is not None and stopped.outcome is not None:  # never sent: ended here
            self._after_end(stopped)
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
        self.follow_chat_model(chat)
        self.window.chat_title.setText(chat.title)
        # Every message's place among its versions from one read of the chat (a query per
        # message was ~15 ms of GUI-thread time for 200 messages, scripts/bench_gui_stalls.py c).
        places = self.store.version_places(chat_id)
        items = [self._item_for(m, places.get(m.id)) for m in self.store.active_path(chat_id)]
        view = self.window.message_view
        view.set_messages(items)
        if not items:
            view.set_placeholder("Start the conversation below. Drop documents to ask about them.")
        self._show_attachments()
        self._update_send_state()
        self._show_speed(chat_id, items)
        if chat_id not in self._last_usage:
            # Counted a moment later: the worker's template rendering and tokenizing compete
            # with the GUI thread for the interpreter and the cores while the chat's first
            # messages are laid out (scripts/bench_gui_stalls.py c).
            QTimer.singleShot(COUNT_DELAY_MS, self, lambda: self._count_if_shown(chat_id))
        self._update_context_meter()

    def _count_if_shown(self, chat_id: int) -> None:
        if chat_id == self.current_chat_id and chat_id not in self._last_usage:
            self._count_chat(chat_id)

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
            self.bridge.count_chat(chat_id, chat_messages(self.store.get_chat(chat_id), path))

    def _on_chat_counted(self, chat_id: int, tokens: int) -> None:
        if self.model_info is None or chat_id in self._last_usage:
            return  # a reply's own figures arrived first: they are newer
        self._last_usage[chat_id] = (tokens, 0, self.model_info.context_length)
        if chat_id == self.current_chat_id:
            self._update_context_meter()

    def _item_for(self, message, place: tuple[int, int] | None = None) -> MessageItem:
        """The view's item for a stored message; `place` (index among its versions, how
        many) when the caller read it already (ChatStore.version_places)."""
        if place is None:
            versions = self.store.versions(message.id)
            place = (versions.index, versions.count)
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
        ended = message.role == "assistant" and not live
        cut = ended and status == COMPLETE and is_cut(meta)
        mode = chat_mode(self.store.get_chat(message.chat_id).settings) if message.attachments else ""
        names = tuple(f"{a.name} (searched)" if is_searched(a, mode) else a.name
                      for a in message.attachments)
        item = MessageItem(
            message_id=message.id, role=message.role, text=text, status=status,
            version_index=place[0], version_count=place[1],
            attachments=names, info=info,
            error=message.error or "", progress=reply.progress_text() if live else "", cut=cut,
            can_continue=ended and can_continue(status, meta, text),
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
        self.remember_chat_model(chat_id)
        attachments = [NewAttachment(name=c.name, kind=c.document.kind, text=c.document.text,
                                     token_count=max(c.tokens or 0, 0),
                                     size_bytes=c.document.size_bytes,
                                     sha256=c.sha256 if c.index == SEARCHED else None)
                       for c in chips]
        try:
            reply_id = self.chat.add_turn(chat_id, text, attachments,
                                          also=lambda: self._maybe_title(chat_id, text, chips))
        except StorageError as exc:
            self._alert("Could not save the message", str(exc))
            return
        self.pending.pop(chat_id, None)
        self.window.composer.clear_text()
        held = self.model_info is None
        self._start_reply(chat_id, reply_id, held=held)
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

    def _start_reply(self, chat_id: int, reply_id: int, held: bool = False) -> None:
        """Start the reply `reply_id` (saved empty and streaming): submit the conversation
        before it now, or once the model is ready when `held`."""
        self._show_started(self.chat.begin(chat_id, reply_id, held=held))

    def _show_started(self, reply: ActiveReply) -> None:
        if not reply.held:
            self._submit(reply)
        if reply.chat_id == self.current_chat_id:
            self._show_new_messages(reply.chat_id, self.store.active_path(reply.chat_id))
        self.refresh_chat_list()

    def _submit(self, reply: ActiveReply) -> None:
        """Send the reply's prompt; a chat with searched documents first asks the document
        worker for the question's passages (then `_on_retrieved` submits)."""
        context = self.model_info.context_length if self.model_info else 0
        used = self._last_usage.get(reply.chat_id, (0, 0, 0))[0]
        plan = self.chat.search_plan(reply, context, used)
        if plan is not None:
            self.documents.retrieve(plan.request_id, plan.question, plan.sources, plan.k)
            return
        self.chat.submit(reply)

    def _on_retrieved(self, request_id: str, retrieved) -> None:
        """The question's passages: the service saves them with the reply (reopening the
        chat shows them) and submits the prompt that numbers them."""
        reply = self.chat.passages_found(request_id, retrieved)
        if reply is None:
            return  # stopped while searching
        if reply.outcome is not None:  # could not be saved
            self._after_end(reply)
            return
        self._refresh_message(reply)
        self._refresh_chat_item(reply.chat_id)  # the list's badge: no longer "searching"

    def _on_retrieve_failed(self, request_id: str, message: str) -> None:
        reply = self.replies.get(request_id)
        if reply is not None and reply.searching:
            self._fail(reply, message)

    def _submit_held(self) -> None:
        """The model is ready: send what waited for it."""
        held = self.chat.release_held()
        for reply in held:
            self._submit(reply)
            self._refresh_message(reply)
            self._refresh_chat_item(reply.chat_id)
        if held:
            self.window.statusBar().showMessage(
                f"The model is ready: sending your queued message{'s' * (len(held) > 1)}.", 8000)

    def _fail_held(self, message: str) -> None:
        """The model could not be loaded: what waited for it fails with the reason (the
        question stays; Retry sends it once a model is loaded)."""
        for reply in self.chat.fail_held(f"Not sent: the model could not be loaded. {message}"):
            self._after_end(reply)

    def continue_reply(self, message_id: int) -> None:
        """Carry on a reply cut by the token limit, stopped or interrupted: the same message
        grows, no new turn (on a remote model too: the server continues the final assistant
        message)."""
        message = self.store.get_message(message_id)
        if self.chat.busy(message.chat_id) or self.model_info is None:
            self.window.statusBar().showMessage("Wait for the model and the current reply.", 5000)
            return
        self._show_started(self.chat.begin_continue(message_id))

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
        reply = self.chat.stop(self.current_chat_id)
        if reply is not None and reply.outcome is not None:  # never sent: ended at once
            self._after_end(reply)
        elif reply is not None:
            self.window.statusBar().showMessage("Stopping…", 2000)

    def regenerate(self, message_id: int) -> None:
        """Regenerate, or Retry on a failed reply: a new version; the old one (with any
        partial text) stays as an earlier version."""
        message = self.store.get_message(message_id)
        if self.chat.busy(message.chat_id) or self.model_info is None:
            self._update_send_state()
            self.window.statusBar().showMessage("Wait for the model and the current reply.", 5000)
            return
        self._start_reply(message.chat_id, self.chat.new_version(message_id))

    def edit_and_resend(self, message_id: int, text: str) -> None:
        message = self.store.get_message(message_id)
        if self.chat.busy(message.chat_id) or self.model_info is None:
            self.window.statusBar().showMessage("Wait for the model and the current reply.", 5000)
            return
        self._start_reply(message.chat_id, self.chat.edit(message_id, text))
        self.window.composer.focus_input()  # the editor is gone; the next message goes here

    def switch_version(self, message_id: int, delta: int) -> None:
        versions = self.store.versions(message_id)
        target = versions.index + delta
        if 0 <= target < versions.count:
            message = self.store.get_message(message_id)
            self.store.switch_version(versions.messages[target].id)
            self.show_chat(message.chat_id)

    # ---- engine events -----------------------------------------------------------------

    def _on_unclaimed_event(self, event) -> None:
        if event.request_id in self._title_jobs:
            self._on_title_event(event)

    def _on_reply_changed(self, reply: ActiveReply, event) -> None:
        if isinstance(event, Queued):
            self._refresh_chat_item(reply.chat_id)
        elif isinstance(event, PrefillProgress):
            if self.model_info:
                self._restored[reply.chat_id] = event.restored
                self._last_usage[reply.chat_id] = (event.total, event.cached,
                                                   self.model_info.context_length)
                if reply.chat_id == self.current_chat_id:
                    self._update_context_meter()
            self._refresh_chat_item(reply.chat_id)
        elif isinstance(event, Token) and reply.tokens == 1:
            self._refresh_chat_item(reply.chat_id)  # the list's badge: writing
        self._refresh_message(reply)

    def _show_streaming(self) -> None:
        """On the save beat: the live figures of what streams (tok/s, the meter)."""
        for reply in self.replies.all():
            if reply.state == STREAMING and self.model_info:
                # The conversation holds the prompt and the reply so far.
                self._last_usage[reply.chat_id] = (reply.total + reply.tokens, reply.cached,
                                                   self.model_info.context_length)
            if reply.chat_id == self.current_chat_id and reply.state == STREAMING:
                self.window.speed_label.setText(f"{reply.tokens_per_second():.1f} tok/s")
                self._update_context_meter()

    def _after_end(self, reply: ActiveReply) -> None:
        """A reply ended and the service saved it (`reply.outcome`): show how."""
        outcome = reply.outcome
        if outcome.continue_failed:  # the reply stays as it was
            self._after_reply(reply)
            self._alert("Could not continue the reply", outcome.error or "")
            return
        if outcome.error and outcome.status != ERROR:  # ended well, but not saved
            self._alert("Could not save the reply", outcome.error)
        usage, timings = outcome.usage, outcome.timings
        if usage is None and outcome.status == ERROR:
            # Failed before the model said how long the conversation is (one too long for
            # the context, say): count it again, so the meter shows by how much.
            self._last_usage.pop(reply.chat_id, None)
            if reply.chat_id == self.current_chat_id:
                self._count_chat(reply.chat_id)
        if usage is not None and self.model_info:
            self._restored[reply.chat_id] = usage.restored_tokens
            self._last_usage[reply.chat_id] = (usage.prompt_tokens + usage.completion_tokens,
                                               usage.cached_tokens, self.model_info.context_length)
        if usage is not None and reply.chat_id == self.current_chat_id:
            self.window.speed_label.setText(f"{timings.decode_tokens_per_s:.1f} tok/s")
            if usage.restored_tokens:  # why this follow-up started quickly after a restart
                self.window.statusBar().showMessage(
                    f"Restored {usage.restored_tokens:,} tokens of this conversation from "
                    "the disk cache instead of reading them again.", 10000)
        self._after_reply(reply)
        if outcome.status == COMPLETE and usage is not None:
            self._maybe_ask_for_title(reply.chat_id)

    def _fail(self, reply: ActiveReply, message: str) -> None:
        """End `reply` with `message` here (not from the backend: an overflow, a search that
        failed); its text so far is kept."""
        self.wiring.fail(reply.request_id, message)

    def _after_reply(self, reply: ActiveReply) -> None:
        self._refresh_chat_item(reply.chat_id)
        if reply.chat_id == self.current_chat_id:
            self.window.message_view.update_message(
                self._item_for(self.store.get_message(reply.message_id)))
            self._update_send_state()
            self._update_context_meter()

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
        if loaded.connection_id != connection_id:  # None: a local model
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
        self.wiring.stop()
        self.chat.close()
        self.documents.shutdown()
        self.bridge.shutdown()
        self.connections.close()

