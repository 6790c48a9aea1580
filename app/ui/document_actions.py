"""The document half of the controller: files dropped or attached become chips (read and
counted in the worker), travel with the next message, and -- when they do not fit the
context -- are shortened only if the person chooses. A mixin of `ChatController`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.documents import Document
from app.storage import NewAttachment
from app.ui.model_actions import is_model_folder
from app.ui.qt import QtWidgets
from app.ui.view_models import AttachmentChip


@dataclass
class PendingAttachment:
    key: str
    name: str
    document: Document | None = None
    tokens: int | None = None


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

    def _on_tokens_counted(self, key: str, tokens: int) -> None:
        """A chip read before the model was loaded gets its count once it is."""
        chip = self._find_pending(key)
        if chip is not None and tokens >= 0:
            chip.tokens = tokens
            self._show_attachments()

    def _on_document_failed(self, key: str, message: str) -> None:
        self._remove_attachment(key)
        self._alert("This file cannot be attached", message)

    def _remove_attachment(self, key: str) -> None:
        self.bridge.cancel_document(key)  # still being read: stop reading it
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

