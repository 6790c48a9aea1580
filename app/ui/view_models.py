"""Plain data the widgets display. The controller builds these from the store and the
engine's events; widgets never see the store, the engine or torch."""

from __future__ import annotations

from dataclasses import dataclass

# Message display states: the stored statuses plus the live ones of a reply in progress,
# defined once where replies are tracked.
from app.chat.replies import (COMPLETE, ERROR, INTERRUPTED, PREFILLING, QUEUED,  # noqa: F401
                              STOPPED, STREAMING)

LIVE_STATUSES = (QUEUED, PREFILLING, STREAMING)


@dataclass(frozen=True)
class CitedPassage:
    """A passage as a reply shows it: its number, where it is from, its text."""

    number: int
    where: str  # "report.pdf, page 3, “Methods”"
    text: str


@dataclass(frozen=True)
class MessageItem:
    message_id: int
    role: str  # "user" | "assistant" | "system"
    text: str  # Markdown
    status: str = COMPLETE
    version_index: int = 0  # 0-based position among the message's versions
    version_count: int = 1
    attachments: tuple[str, ...] = ()  # file names
    info: str = ""  # e.g. "31.8 tok/s · 120 tokens"
    error: str = ""
    progress: str = ""  # e.g. "Reading the prompt… 45% (1,200 / 2,700 tokens, 800 cached)"
    cut: bool = False  # stopped by the token limit (the info line says so)
    can_continue: bool = False  # the view offers Continue (metadata.can_continue)
    reasoning: str = ""  # a reasoning model's thinking (shown collapsed above the answer)
    reasoning_label: str = ""  # e.g. "Thought for 4 s", "Thinking…"
    passages: tuple[CitedPassage, ...] = ()  # what a reply answered from; its [n] cite them


@dataclass(frozen=True)
class AttachmentChip:
    key: str  # stable id for removal
    name: str
    tokens: int | None  # None while being counted
    warning: str = ""  # e.g. "2,300 tokens over the context"
    mode: str = ""  # how the chat uses it: "whole", "searched (42 passages)", "indexing…"
    progress: int | None = None  # indexing: percent done, -1 while it cannot tell yet
