"""The reply lifecycle, apart from any window: a Qt-free chat service.

    ChatService(store, send, abort)

owns what happens to a reply from the moment its (empty, "streaming") message is saved:

    begin -> [held for the model] -> [searching its documents] -> submitted
          -> QUEUED -> PREFILLING -> STREAMING -> COMPLETE | STOPPED | ERROR

It builds the prompt (app/chat/prompt.py, byte-identical from turn to turn), hands a
`SubmitRequest` to `send` (the window's bridge worker, or `dispatch` straight to a
ChatBackend), turns the backend's events into the reply's state (`apply`, on the service's one
thread: the events' own thread hands them over first), saves the text while it streams
(`save_streams`) and saves the end with its metadata (app/chat/metadata.py). A failure keeps
the text so far and its message; Stop keeps the text so far; a failed Continue leaves the
reply as it was. The window's part is only to show it (app/ui/controller.py).

The service knows no model: `model` is told which one answers (`set_model`), and
`send`/`abort` are where requests go. Its tests run with a ScriptedBackend and no Qt.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.chat.budget import reply_room
from app.chat.documents import (PASSAGES_KEY, chat_mode, passages_that_fit, passages_to_metadata,
                                search_question, searched_sources)
from app.chat.metadata import finished_metadata, keep_passages
from app.chat.prompt import chat_messages
from app.chat.replies import (COMPLETE, ERROR, PREFILLING, QUEUED, STOPPED, STREAMING,
                              ActiveReply, Outcome, ReplyBook)
from app.engine.events import Failed, Finished, PrefillProgress, Queued, Token
from app.storage import NewAttachment, StorageError


@dataclass(frozen=True)
class SubmitRequest:
    """What a reply asks of a backend: plain data, safe to hand to another thread."""

    request_id: str
    chat_id: int
    messages: tuple  # app.models.chat_template.Message, in order
    params: object  # SamplingParams
    partial: str = ""  # Continue: the reply so far, which the model carries on
    session_id: str = ""  # the chat's stable id: cache owner locally, session header remotely


@dataclass(frozen=True)
class SearchPlan:
    """A reply that first needs its question's passages (the window's document worker)."""

    request_id: str
    question: str
    sources: list  # (sha256, name)
    k: int  # how many passages fit


def dispatch(backend, request: SubmitRequest, on_event) -> str:
    """Hand `request` to a ChatBackend (app/backends/base.py); its events go to `on_event`
    on the backend's thread. The one place a SubmitRequest meets the seam."""
    return backend.submit_chat(request.messages, request.params, on_event, request.request_id,
                               session_id=request.session_id or None, partial=request.partial)


class ChatService:
    """One per window (or test). Not thread-safe: call it from one thread; events from a
    backend's thread must be handed to that thread before `apply`."""

    def __init__(self, store, send: Callable[[SubmitRequest], None],
                 abort: Callable[[str], None], sampling: Callable[[object], object]):
        """`store`: the ChatStore; `sampling(chat)`: the chat's SamplingParams."""
        self.store = store
        self.send = send
        self.abort = abort
        self.sampling = sampling
        self.replies = ReplyBook()
        self.model_name = ""
        self.backend_kind = ""
        # message -> (status, error, metadata) before a Continue, put back if it fails
        self._continued: dict[int, tuple[str, str | None, dict]] = {}
        self._ids = itertools.count(1)

    def set_model(self, name: str, backend_kind: str) -> None:
        """Who answers the next replies (saved in their metadata)."""
        self.model_name, self.backend_kind = name, backend_kind

    # ---- starting replies ----------------------------------------------------------------

    def add_turn(self, chat_id: int, text: str, attachments: Sequence[NewAttachment] = (),
                 also: Callable[[], None] | None = None) -> int:
        """Save the person's message and an empty reply after it, in one transaction (with
        `also`, e.g. a title, inside it); returns the reply's message id. StorageError
        leaves nothing saved."""
        with self.store.transaction():
            self.store.add_message(chat_id, "user", text.strip(), attachments=list(attachments))
            reply = self.store.add_message(chat_id, "assistant", "", status=STREAMING)
            if also is not None:
                also()
        return reply.id

    def new_version(self, message_id: int) -> int:
        """Regenerate (Retry on a failed reply): a new empty version of the reply; the old
        one, with its partial text, stays as an earlier version."""
        return self.store.add_version(message_id, "", status=STREAMING).id

    def edit(self, message_id: int, text: str) -> int:
        """A new version of the person's message `message_id` and an empty reply to it."""
        message = self.store.get_message(message_id)
        attachments = [NewAttachment(a.name, a.kind, a.text, a.token_count, a.size_bytes, a.sha256)
                       for a in message.attachments]
        with self.store.transaction():
            self.store.add_version(message_id, text.strip(), attachments=attachments)
            reply = self.store.add_message(message.chat_id, "assistant", "", status=STREAMING)
        return reply.id

    def begin(self, chat_id: int, message_id: int, *, held: bool = False,
              prefix: str = "") -> ActiveReply:
        """Track the reply `message_id` (empty, or `prefix` to carry on). Not sent yet: the
        caller submits it (`submit`, or `search_plan` first), unless `held` for the model."""
        reply = ActiveReply(f"chat{chat_id}-{next(self._ids)}", chat_id, message_id, text=prefix,
                            held=held, prefix=prefix)
        self.replies.add(reply)
        return reply

    def begin_continue(self, message_id: int) -> ActiveReply:
        """Carry on a reply (cut by the token limit, stopped, interrupted; see
        metadata.can_continue): the same message grows, no new turn."""
        message = self.store.get_message(message_id)
        self._continued[message_id] = (message.status, message.error,
                                       dict(message.metadata or {}))
        self.store.update_message(message_id, status=STREAMING)
        return self.begin(message.chat_id, message_id, prefix=message.content)

    def busy(self, chat_id: int) -> bool:
        return self.replies.for_chat(chat_id) is not None

    def request_for(self, reply: ActiveReply) -> SubmitRequest:
        """The reply's prompt: the conversation before it, as the model reads it."""
        chat = self.store.get_chat(reply.chat_id)
        path = self.store.active_path(reply.chat_id)
        messages = tuple(chat_messages(chat, path, leave_out=reply.message_id))
        return SubmitRequest(reply.request_id, reply.chat_id, messages, self.sampling(chat),
                             partial=reply.prefix, session_id=str(chat.id))

    def submit(self, reply: ActiveReply) -> None:
        reply.held = reply.searching = False
        reply.started_at = time.monotonic()
        self.send(self.request_for(reply))

    def release_held(self) -> list[ActiveReply]:
        """The model is ready: submit every reply that waited for it (those that must
        search their documents first are left to the caller, with `searching` set)."""
        held = [r for r in self.replies.all() if r.held]
        for reply in held:
            reply.held = False
        return held

    # ---- documents first -----------------------------------------------------------------

    def search_plan(self, reply: ActiveReply, context: int, used: int) -> SearchPlan | None:
        """A chat with searched documents: a new reply first needs the question's passages
        (`context`: the model's; `used`: the conversation's tokens). None when there is
        nothing to search or the reply already has its passages (a Continue, a retry)."""
        chat = self.store.get_chat(reply.chat_id)
        path = self.store.active_path(reply.chat_id)
        index = next((i for i, m in enumerate(path) if m.id == reply.message_id), None)
        sources = searched_sources(path, chat_mode(chat.settings))
        if (not sources or reply.prefix or index is None or index == 0
                or PASSAGES_KEY in (path[index].metadata or {})):
            return None
        reply.searching = True
        room = reply_room(self.sampling(chat).max_tokens)
        k = passages_that_fit(context, used, room) if context else 1
        return SearchPlan(reply.request_id, search_question(path[index - 1]), sources, k)

    def passages_found(self, request_id: str, retrieved) -> ActiveReply | None:
        """The passages arrived: saved with the reply (reopening the chat shows them) and
        the reply is submitted. None when it was stopped meanwhile."""
        reply = self.replies.get(request_id)
        if reply is None or not reply.searching:
            return None
        reply.searching = False
        try:
            self.store.update_message(reply.message_id,
                                      metadata={PASSAGES_KEY: passages_to_metadata(retrieved)})
        except StorageError as exc:
            self.fail(reply, str(exc))
            return reply
        reply.view_item = None
        self.submit(reply)
        return reply

    # ---- events --------------------------------------------------------------------------

    def apply(self, event) -> ActiveReply | None:
        """One backend event for a reply this service runs (None for anything else). After a
        Finished or Failed the reply is saved and `reply.outcome` says how it ended."""
        reply = self.replies.get(event.request_id)
        if reply is None:
            return None
        if isinstance(event, Queued):
            reply.state, reply.total = QUEUED, event.prompt_tokens
        elif isinstance(event, PrefillProgress):
            reply.state, reply.done, reply.total, reply.cached, reply.restored = (
                PREFILLING, event.done, event.total, event.cached, event.restored)
        elif isinstance(event, Token):
            if reply.state != STREAMING:
                reply.state = STREAMING
                reply.first_token_at = time.monotonic()
            reply.tokens += 1
            reply.text += event.text
            reply.note_reasoning(time.monotonic())
        elif isinstance(event, Finished):
            self.finish(reply, event)
        elif isinstance(event, Failed):
            self.fail(reply, event.message)
        return reply

    def finish(self, reply: ActiveReply, event: Finished) -> None:
        self.replies.pop(reply.request_id)
        status = STOPPED if event.finish_reason == "abort" else COMPLETE
        earlier = self._continued.pop(reply.message_id, (None, None, {}))[2] if reply.prefix else {}
        metadata = finished_metadata(self.model_name, self.backend_kind, event, earlier=earlier,
                                     thinking_s=reply.thinking_s)
        reply.text = reply.prefix + event.text
        error = self._save(reply, reply.text, status, None, metadata)
        reply.outcome = Outcome(status, error, event.usage, event.timings, event.finish_reason)

    def fail(self, reply: ActiveReply, message: str) -> None:
        """End a reply with `message`: its text so far is kept and saved with the error (a
        Continue that failed before writing anything keeps the reply as it was: its status,
        error and metadata; one cut mid-stream keeps what it wrote, as any reply does)."""
        self.replies.pop(reply.request_id)
        earlier = self._continued.pop(reply.message_id, None) if reply.prefix else None
        if reply.prefix and reply.text == reply.prefix:
            status, error, metadata = earlier or (COMPLETE, None, {})
            self._save(reply, reply.prefix, status, error, metadata)
            reply.text = reply.prefix
            reply.outcome = Outcome(status, message, continue_failed=True)
            return
        saved = self._save(reply, reply.text, ERROR, message, earlier[2] if earlier else {})
        reply.outcome = Outcome(ERROR, saved or message)

    def _save(self, reply: ActiveReply, text: str, status: str, error: str | None,
              metadata: dict) -> str | None:
        """Write the reply's end; the StorageError's message when that failed."""
        try:
            stored = self.store.get_message(reply.message_id).metadata
            self.store.update_message(reply.message_id, content=text, status=status, error=error,
                                      metadata=keep_passages(stored, metadata))
        except StorageError as exc:
            return f"Could not save the reply: {exc}"
        reply.mark_saved()
        return None

    # ---- stopping and saving -------------------------------------------------------------

    def stop(self, chat_id: int) -> ActiveReply | None:
        """Stop the chat's reply. One never sent (held, searching) ends here, STOPPED with
        what it had; a running one is aborted and ends when the backend's Finished(abort)
        arrives, with the text so far."""
        reply = self.replies.for_chat(chat_id)
        if reply is None:
            return None
        if reply.held or reply.searching:
            self.replies.pop(reply.request_id)
            reply.outcome = Outcome(STOPPED, self._save(reply, reply.text, STOPPED, None, {}))
        else:
            self.abort(reply.request_id)
        return reply

    def fail_held(self, message: str) -> list[ActiveReply]:
        held = [r for r in self.replies.all() if r.held]
        for reply in held:
            self.fail(reply, message)
        return held

    def save_streams(self) -> list[str]:
        """Save every reply whose text changed since its last save; the errors, in words."""
        errors = []
        for reply in self.replies.all():
            if reply.due_for_save():
                try:
                    self.store.update_message(reply.message_id, content=reply.text)
                    reply.mark_saved()
                except StorageError as exc:
                    errors.append(str(exc))
        return errors

    def close(self) -> None:
        """The app is closing: save what runs (stopped, with its text; a Continue that
        wrote nothing stays complete); a reply never sent says why it is empty."""
        for reply in self.replies.all():
            if reply.held:
                self.store.update_message(reply.message_id, status=ERROR,
                                          error="Not sent: the app closed before the model was ready.")
                continue
            self.store.update_message(reply.message_id, content=reply.text,
                                      status=COMPLETE if reply.prefix and not reply.tokens else STOPPED)
        self.replies = ReplyBook()
