"""The document half of the controller: files dropped or attached become chips (read and
counted in the worker), travel with the next message, and -- when they do not fit the
context -- are indexed and searched (the chat's documents mode, app/ui/document_plan.py),
or shortened only if the person chooses. A mixin of `ChatController`.

A chip's indexing runs in the document worker (app/ui/retrieval_worker.py) with progress
and Cancel on the chip; a cancelled or failed index leaves the document to go whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.chat.budget import reply_room
from app.documents import Document
from app.storage import NewAttachment
from app.ui.document_plan import chat_mode, is_searched, should_index
from app.ui.model_actions import is_model_folder
from app.ui.qt import QtWidgets
from app.ui.view_models import AttachmentChip

# A chip's index state: not indexed, being indexed, searched, or indexing stopped/failed
# (then the document goes whole).
NOT_INDEXED, INDEXING, SEARCHED, INDEX_STOPPED = "", "indexing", "searched", "stopped"


@dataclass
class PendingAttachment:
    key: str
    name: str
    document: Document | None = None
    tokens: int | None = None
    path: str = ""
    index: str = NOT_INDEXED
    index_done: int = 0
    index_total: int = 0
    passages: int = 0
    sha256: str | None = None  # of the file, once indexed

    @property
    def goes_whole(self) -> bool:
        """Counted against the context: it goes in whole (indexing it did not finish)."""
        return self.index not in (INDEXING, SEARCHED)


class DocumentActions:
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
        """Dropped or chosen paths: model files and model folders are offered for the
        picker, other folders refused, the rest attached as documents."""
        models = [p for p in paths if p.lower().endswith(".gguf") or Path(p).is_dir()]
        documents = [p for p in paths if p not in models]
        for path in models:
            kind = "model folder" if Path(path).is_dir() else "model file"
            if not Path(path).is_dir() or is_model_folder(path):
                if self._confirm("Add a model?", f"{Path(path).name} is a {kind}. Add it to "
                                                 "the model picker?"):
                    self.add_model_paths([path])
            else:
                self._alert("Folders cannot be attached",
                            f"{Path(path).name} is a folder. Attach the files inside it, or "
                            "drop a model folder (with config.json) to add a model.")
        if self.current_chat_id is None:
            return
        for path in documents:  # the worker reads each; a refusal comes back as a clear alert
            key = f"att{next(self._attachment_ids)}"
            self.pending.setdefault(self.current_chat_id, []).append(
                PendingAttachment(key, Path(path).name, path=path))
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
        self._plan_indexing(self._chat_of_chip(key))
        self._show_attachments()

    def _on_tokens_counted(self, key: str, tokens: int) -> None:
        """A chip read before the model was loaded gets its count once it is."""
        chip = self._find_pending(key)
        if chip is not None and tokens >= 0:
            chip.tokens = tokens
            self._plan_indexing(self._chat_of_chip(key))
            self._show_attachments()

    def _chat_of_chip(self, key: str) -> int | None:
        return next((chat_id for chat_id, chips in self.pending.items()
                     if any(c.key == key for c in chips)), None)

    # -- indexing documents that are searched ------------------------------------------

    def _plan_indexing(self, chat_id: int | None) -> None:
        """Index the chat's waiting chips when its mode says so: "search" always, "auto"
        when the conversation, the documents going whole and room for a reply exceed the
        context (app/ui/document_plan.should_index)."""
        if chat_id is None:
            return
        chips = self._pending_for(chat_id)
        waiting = [c for c in chips if c.document is not None and c.index == NOT_INDEXED]
        if not waiting:
            return
        mode = chat_mode(self.store.get_chat(chat_id).settings)
        if mode == "auto" and (self.model_info is None or any(c.tokens is None for c in waiting)):
            return  # decided once the model has counted them
        context = self.model_info.context_length if self.model_info else 0
        used = self._last_usage.get(chat_id, (0, 0, 0))[0]
        whole = sum(max(c.tokens or 0, 0) for c in chips if c.goes_whole)
        if should_index(mode, used, whole, context, self._reply_room(chat_id)):
            for chip in waiting:
                chip.index, chip.index_done, chip.index_total = INDEXING, 0, 0
                self.documents.index(chip.key, chip.path)

    def _reply_room(self, chat_id: int) -> int:
        """Tokens a reply should have left (the context budget's reply_room)."""
        return reply_room(self._sampling_params(self.store.get_chat(chat_id)).max_tokens)

    def _on_index_progress(self, key: str, done: int, total: int) -> None:
        chip = self._find_pending(key)
        if chip is not None and chip.index == INDEXING:
            chip.index_done, chip.index_total = done, total
            self._show_attachments()

    def _on_indexed(self, key: str, sha256: str, passages: int) -> None:
        chip = self._find_pending(key)
        if chip is not None:
            chip.index, chip.sha256, chip.passages = SEARCHED, sha256, passages
            self._show_attachments()

    def _on_index_cancelled(self, key: str) -> None:
        chip = self._find_pending(key)
        if chip is not None:
            chip.index = INDEX_STOPPED
            self._show_attachments()

    def _on_index_failed(self, key: str, message: str) -> None:
        chip = self._find_pending(key)
        if chip is None:
            return
        chip.index = INDEX_STOPPED
        self._show_attachments()
        self._alert("The document could not be indexed", f"{message}\n\n{chip.name} will be "
                    "sent whole if you send it.")

    def _cancel_indexing(self, key: str) -> None:
        self.documents.cancel(key)
        self.window.statusBar().showMessage("Indexing stopped; what was indexed is kept: attach "
                                            "the file again to carry on.", 8000)

    @staticmethod
    def _chip_mode(chip: PendingAttachment) -> tuple[str, int | None]:
        """The chip's mode label and indexing percent (None when not indexing)."""
        if chip.index == INDEXING:
            if not chip.index_total:
                return "indexing…", -1
            percent = 100 * chip.index_done // chip.index_total
            return f"indexing {percent}%", percent
        if chip.index == SEARCHED:
            return f"searched ({chip.passages:,} passage{'s' * (chip.passages != 1)})", None
        if chip.index == INDEX_STOPPED:
            return "whole (indexing stopped)", None
        return ("whole" if chip.document is not None else ""), None

    def _on_document_failed(self, key: str, message: str) -> None:
        self._remove_attachment(key)
        self._alert("This file cannot be attached", message)

    def _remove_attachment(self, key: str) -> None:
        self.bridge.cancel_document(key)  # still being read: stop reading it
        self.documents.cancel(key)  # or indexed
        for chat_id, chips in self.pending.items():
            self.pending[chat_id] = [c for c in chips if c.key != key]
        self._show_attachments()

    def _show_attachments(self) -> None:
        chips = self._pending_for(self.current_chat_id)
        context = self.model_info.context_length if self.model_info else None
        used = self._last_usage.get(self.current_chat_id, (0, 0, 0))[0] if self.current_chat_id else 0
        total = used + sum(max(c.tokens or 0, 0) for c in chips if c.goes_whole)
        views = []
        for chip in chips:
            warning = ""
            if context and chip.tokens and chip.goes_whole and total > context:
                warning = f"{total - context:,} tokens over the context"
            mode, progress = self._chip_mode(chip)
            views.append(AttachmentChip(chip.key, chip.name, chip.tokens, warning, mode, progress))
        self.window.composer.set_attachments(views)
        self._update_context_meter()

    def _on_context_overflow(self, request_id: str, prompt_tokens: int, context: int) -> None:
        """Never truncate silently: say how far over it is and let the person choose."""
        reply = self.replies.get(request_id)
        if reply is None:
            return
        over = prompt_tokens - context
        room = self._reply_room(reply.chat_id)
        message = (f"This conversation is {prompt_tokens:,} tokens but the model holds "
                   f"{context:,}{f' ({over:,} over)' if over > 0 else ''}, leaving no room for "
                   "a reply.")
        self._fail(reply, message)
        user = self.store.get_message(self.store.get_message(reply.message_id).parent_id)
        mode = chat_mode(self.store.get_chat(reply.chat_id).settings)
        if user.attachments and all(is_searched(a, mode) for a in user.attachments):
            self._alert("The conversation is too long", message + " Only passages of the "
                        "searched documents were sent; start a new chat, or choose a larger "
                        "context in Preferences.")
        elif user.attachments and self._confirm(
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
        mode = chat_mode(self.store.get_chat(user.chat_id).settings)
        shortened = []
        for a in attachments:
            text, tokens = a.text, a.token_count
            if cut_tokens > 0 and tokens > 0 and not is_searched(a, mode):  # only whole ones
                take = min(tokens, cut_tokens)
                keep_chars = int(len(text) * (tokens - take) / tokens * 0.95)
                text = text[:keep_chars] + ("\n[… the rest of this document was cut to fit the "
                                            "model's context]" if keep_chars else "")
                cut_tokens -= take
                tokens -= take
            if text:
                shortened.append(NewAttachment(a.name, a.kind, text, tokens, a.size_bytes,
                                               a.sha256))
        order = {a.name: i for i, a in enumerate(user.attachments)}
        shortened.sort(key=lambda a: order.get(a.name, 0))
        with self.store.transaction():
            self.store.add_version(user.id, user.content, attachments=shortened)
            reply = self.store.add_message(user.chat_id, "assistant", "", status="streaming")
        self._start_reply(user.chat_id, reply.id)

