"""Replies in progress, one per chat at most, tracked by the GUI thread.

A reply's text lives here while it streams and reaches the store at least once a second
(`due_for_save`), so a crash loses at most the last second; the store's copy is what a
restart shows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.ui.view_models import PREFILLING, QUEUED, STREAMING, MessageItem

SAVE_INTERVAL_S = 0.5


@dataclass
class ActiveReply:
    request_id: str
    chat_id: int
    message_id: int
    text: str = ""
    state: str = QUEUED
    done: int = 0  # prompt tokens ready
    total: int = 0
    cached: int = 0
    tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    saved_at: float = field(default_factory=time.monotonic)
    saved_text: str = ""
    view_item: MessageItem | None = None  # what the view showed last, for cheap live updates

    def progress_text(self) -> str:
        if self.state == QUEUED:
            return "Waiting for the model…"
        if self.state == PREFILLING and self.total:
            pct = 100 * self.done // self.total
            cached = f", {self.cached:,} reused from cache" if self.cached else ""
            return f"Reading the prompt… {pct}% ({self.done:,} of {self.total:,} tokens{cached})"
        return ""

    def list_badge(self) -> str:
        if self.state == QUEUED:
            return "queued"
        if self.state == PREFILLING and self.total:
            return f"reading {100 * self.done // self.total}%"
        if self.state == STREAMING:
            return "writing…"
        return ""

    def due_for_save(self) -> bool:
        return self.text != self.saved_text and time.monotonic() - self.saved_at >= SAVE_INTERVAL_S

    def mark_saved(self) -> None:
        self.saved_at = time.monotonic()
        self.saved_text = self.text

    def tokens_per_second(self) -> float:
        if self.tokens < 2 or not self.first_token_at:
            return 0.0
        return (self.tokens - 1) / max(time.monotonic() - self.first_token_at, 1e-6)


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
