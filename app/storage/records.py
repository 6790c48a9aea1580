"""What leaves the store: frozen, plain-data records that can cross threads and Qt signals.

Every read builds fresh records (and fresh dicts inside them), so a caller changing a
record's `settings` or `metadata` dict changes nothing in the store or in other callers' copies.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
STATUSES = ("complete", "streaming", "stopped", "error", "interrupted")


@dataclass(frozen=True)
class NewAttachment:
    """An attachment to save with a message; the store gives it its ids."""

    name: str
    kind: str  # e.g. "pdf", "docx", "text"
    text: str = ""  # the extracted text the model sees
    token_count: int = 0
    size_bytes: int = 0
    sha256: str | None = None  # of the source file, when it was indexed for retrieval


@dataclass(frozen=True)
class Attachment:
    id: int
    message_id: int
    name: str
    kind: str
    text: str
    token_count: int
    size_bytes: int
    sha256: str | None = None  # of the source file, when it was indexed for retrieval


@dataclass(frozen=True)
class Message:
    """One node of a chat's message tree. Versions of a message are its siblings: the
    messages with the same parent and role, in order of creation."""

    id: int
    chat_id: int
    parent_id: int | None
    role: str  # one of ROLES
    content: str
    status: str  # one of STATUSES
    error: str | None
    created_at: float
    updated_at: float
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)  # model, token counts, tokens/s, finish reason
    attachments: tuple[Attachment, ...] = ()


@dataclass(frozen=True)
class Chat:
    id: int
    title: str
    created_at: float
    updated_at: float
    pinned: bool
    deleted_at: float | None  # set while soft-deleted (undo is possible until purged)
    model: str | None
    settings: dict[str, Any] = field(default_factory=dict, hash=False)  # per-chat generation settings
    head_message_id: int | None = None  # the leaf of the branch shown; None for an empty chat

    @property
    def deleted(self) -> bool:
        return self.deleted_at is not None


@dataclass(frozen=True)
class Versions:
    """The versions of one message (itself included) and where it stands among them."""

    messages: tuple[Message, ...]
    index: int  # 0-based position of the asked-for message in `messages`

    @property
    def count(self) -> int:
        return len(self.messages)


@dataclass(frozen=True)
class ModelRecord:
    """A model file the person added. Removing the record never touches the file."""

    id: int
    path: str
    name: str
    architecture: str | None
    size_bytes: int | None
    quantization: str | None
    context_length: int | None
    added_at: float
    defaults: dict[str, Any] = field(default_factory=dict, hash=False)  # per-model generation defaults


def chat_from_row(row: sqlite3.Row) -> Chat:
    return Chat(id=row["id"], title=row["title"], created_at=row["created_at"],
                updated_at=row["updated_at"], pinned=bool(row["pinned"]),
                deleted_at=row["deleted_at"], model=row["model"],
                settings=json.loads(row["settings"]), head_message_id=row["head_message_id"])


def attachment_from_row(row: sqlite3.Row) -> Attachment:
    return Attachment(id=row["id"], message_id=row["message_id"], name=row["name"],
                      kind=row["kind"], text=row["text"], token_count=row["token_count"],
                      size_bytes=row["size_bytes"], sha256=row["sha256"])


def message_from_row(row: sqlite3.Row, attachments: tuple[Attachment, ...] = ()) -> Message:
    return Message(id=row["id"], chat_id=row["chat_id"], parent_id=row["parent_id"],
                   role=row["role"], content=row["content"], status=row["status"],
                   error=row["error"], created_at=row["created_at"],
                   updated_at=row["updated_at"], metadata=json.loads(row["metadata"]),
                   attachments=attachments)


def model_from_row(row: sqlite3.Row) -> ModelRecord:
    return ModelRecord(id=row["id"], path=row["path"], name=row["name"],
                       architecture=row["architecture"], size_bytes=row["size_bytes"],
                       quantization=row["quantization"], context_length=row["context_length"],
                       added_at=row["added_at"], defaults=json.loads(row["defaults"]))
