"""Replies in progress, one per chat at most, tracked by the chat service (one thread:
the GUI's, or a test's).

A reply's text lives here while it streams and reaches the store on every save tick on which
it changed (`due_for_save`; the window ticks every app.ui.replies.SAVE_INTERVAL_MS), so a
crash loses at most the last fraction of a second; the store's copy is what a restart shows.

States: a reply is QUEUED (held for the model, searching its documents, or sent and waiting
for the engine), PREFILLING (the prompt is being read), STREAMING, then it ends COMPLETE,
STOPPED or ERROR -- the stored statuses. The text so far is kept whichever way it ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# The statuses a message shows; the live ones exist only while a reply runs, the others are
# what the store keeps (app/ui/view_models.py shows them).
QUEUED, PREFILLING, STREAMING = "queued", "prefilling", "streaming"
COMPLETE, STOPPED, ERROR, INTERRUPTED = "complete", "stopped", "error", "interrupted"


@dataclass
class ActiveReply:
    request_id: str
    chat_id: int
    message_id: int
    text: str = ""  # the whole reply so far (a continued reply starts with its earlier text)
    state: str = QUEUED
    held: bool = False  # sent before the model was ready: submitted once it is
    searching: bool = False  # waiting for the documents' passages: submitted once they come
    prefix: str = ""  # the earlier text a Continue carries on from
    done: int = 0  # prompt tokens ready
    total: int = 0
    cached: int = 0
    restored: int = 0  # of `cached`, read back from the disk cache
    tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    saved_at: float = field(default_factory=time.monotonic)
    saved_text: str = ""
    view_item: Any = None  # what the window showed last (its MessageItem), for cheap updates
    thinking_s: float | None = None  # how long a reasoning model thought, once it stopped
    outcome: "Outcome | None" = None  # set once the reply has ended (and been saved)

    def note_reasoning(self, now: float) -> None:
        """After each token: time the thinking of a reply that opened with <think>."""
        if self.thinking_s is None and self.first_token_at and "</think>" in self.text[-48:] \
                and self.text.lstrip().startswith("<think>"):
            self.thinking_s = now - self.first_token_at

    def progress_text(self) -> str:
        if self.held:
            return "Queued: sent as soon as the model is ready"
        if self.searching:
            return "Searching the documents…"
        if self.state == QUEUED and not self.total:
            return "Preparing the prompt…"
        if self.state in (QUEUED, PREFILLING) and self.total:
            pct = 100 * self.done // self.total
            cached = f", {self.cached:,} reused from cache" if self.cached else ""
            if self.restored:
                cached += f" ({self.restored:,} restored from disk)"
            return f"Reading the prompt… {pct}% ({self.done:,} of {self.total:,} tokens{cached})"
        return ""

    def list_badge(self) -> str:
        if self.searching:
            return "searching"
        if self.state == QUEUED and (self.held or not self.total):
            return "queued"
        if self.state in (QUEUED, PREFILLING) and self.total:
            return f"reading {100 * self.done // self.total}%"
        if self.state == STREAMING:
            return "writing…"
        return ""

    def due_for_save(self) -> bool:
        return self.text != self.saved_text

    def mark_saved(self) -> None:
        self.saved_at = time.monotonic()
        self.saved_text = self.text

    def tokens_per_second(self) -> float:
        if self.tokens < 2 or not self.first_token_at:
            return 0.0
        return (self.tokens - 1) / max(time.monotonic() - self.first_token_at, 1e-6)


@dataclass(frozen=True)
class Outcome:
    """How a reply ended, as saved: `status` COMPLETE, STOPPED or ERROR; `usage` and
    `timings` the engine's (None when it never ran); `continue_failed`: a Continue that
    failed (the reply stays as it was, COMPLETE and cut, and `error` says why)."""

    status: str
    error: str | None = None
    usage: Any = None
    timings: Any = None
    finish_reason: str = ""
    continue_failed: bool = False


class ReplyBook:
    """Active replies by request id and by chat."""

    def __init__(self):
        self._by_request: dict[str, ActiveReply] = {}

    def add(self, reply: ActiveReply) -> None:
        self._by_request[reply.request_id] = reply

    def get(self, request_id: str) -> ActiveReply | None:
        return self._by_request.get(request_id)

    def pop(self, request_id: str) -> ActiveReply | None:
        return self._by_request.pop(request_id, None)

    def for_chat(self, chat_id: int) -> ActiveReply | None:
        for reply in self._by_request.values():
            if reply.chat_id == chat_id:
                return reply
        return None

    def all(self) -> list[ActiveReply]:
        return list(self._by_request.values())

    def __len__(self) -> int:
        return len(self._by_request)
