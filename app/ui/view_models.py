"""Plain data the widgets display. The controller builds these from the store and the
engine's events; widgets never see the store, the engine or torch."""

from __future__ import annotations

from dataclasses import dataclass

# Message display states: the stored statuses plus the live ones of a reply in progress.
QUEUED, PREFILLING, STREAMING = "queued", "prefilling", "streaming"
COMPLETE, STOPPED, ERROR, INTERRUPTED = "complete", "stopped", "error", "interrupted"
LIVE_STATUSES = (QUEUED, PREFILLING, STREAMING)


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
    cut: bool = False  # stopped by the token limit: the view offers Continue
    reasoning: str = ""  # a reasoning model's thinking (shown collapsed above the answer)
    reasoning_label: str = ""  # e.g. "Thought for 4 s", "Thinking…"


@dataclass(frozen=True)
class AttachmentChip:
    key: str  # stable id for removal
    name: str
    tokens: int | None  # None while being counted
    warning: str = ""  # e.g. "2,300 tokens over the context"
