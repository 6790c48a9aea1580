"""Messages: a tree per chat, so every reply version and every edit is kept.

A message's parent is the message it follows (None for the first). Versions of a message are
its siblings -- same parent, same role -- in order of creation; regenerating a reply or
editing a question adds one (`add_version`). The chat's head is the leaf of the branch shown;
`active_path` walks from the root to it. Ids grow with creation, so "by creation" is "by id".
"""

from __future__ import annotations

import enum
import json
import sqlite3
from typing import Any, Iterable, Mapping

from app.storage.base import StoreBase
from app.storage.errors import StorageError
from app.storage.records import (Attachment, Chat, Message, NewAttachment, Versions,
                                 attachment_from_row, chat_from_row, message_from_row)
from app.storage.validate import (check_attachment, check_role, check_status, check_text,
                                  merged, to_json)


class _Default(enum.Enum):
    HEAD = "the chat's head"


HEAD = _Default.HEAD  # add_message's default parent: the chat's current head

_SQL_ID_CHUNK = 500  # ids per `IN (...)`: well under SQLite's bound-variable limit


class MessageTree(StoreBase):
    def add_message(self, chat_id: int, role: str, content: str, *,
                    parent_id: int | None | _Default = HEAD, status: str = "complete",
                    attachments: Iterable[NewAttachment | Attachment] = (),
                    metadata: Mapping[str, Any] | None = None, error: str | None = None) -> Message:
        """Add a message below `parent_id` (default: the head; None: a new root) and make it
        the chat's head. A reply about to stream starts as `status="streaming"`, content ""."""
        with self._write() as conn:
            chat = self._chat_row(conn, chat_id)
            parent = chat["head_message_id"] if parent_id is HEAD else parent_id
            if parent is not None and self._message_row(conn, parent)["chat_id"] != chat_id:
                raise StorageError(f"Message {parent} belongs to another chat than chat {chat_id}.")
            message_id = self._insert(conn, chat_id, parent, role, content, status, attachments,
                                      metadata, error)
            self._set_head(conn, chat_id, message_id, touch=True)
            return self._load(conn, message_id)

    def add_version(self, of_message_id: int, content: str, *, role: str | None = None,
                    status: str = "complete",
                    attachments: Iterable[NewAttachment | Attachment] = (),
                    metadata: Mapping[str, Any] | None = None) -> Message:
        """A new version (sibling) of a message, made the head: regenerate adds one to a reply
        (content "", status "streaming"), edit-and-resend adds one to a question."""
        with self._write() as conn:
            original = self._message_row(conn, of_message_id)
            if role is not None and role != original["role"]:
                raise StorageError(f"A version of a {original['role']} message must also be a "
                                   f"{original['role']} message, not a {role} one.")
            role = original["role"]
            message_id = self._insert(conn, original["chat_id"], original["parent_id"], role,
                                      content, status, attachments, metadata, None)
            self._set_head(conn, original["chat_id"], message_id, touch=True)
            return self._load(conn, message_id)

    def update_message(self, message_id: int, content: str | None = None, status: str | None = None,
                       error: str | None = None, metadata: Mapping[str, Any] | None = None) -> Message:
        """Change what is given (None: leave as is). `content` replaces the text; `metadata`
        is merged (a None value drops a key); `error=""` clears the error. Saved for good when
        this returns -- cheap enough to call about once a second while a reply streams."""
        with self._write() as conn:
            row = self._message_row(conn, message_id)
            changes: dict[str, Any] = {"updated_at": self._now()}
            if content is not None:
                changes["content"] = check_text(content, "A message's content")
            if status is not None:
                changes["status"] = check_status(status)
            if error is not None:
                changes["error"] = check_text(error, "A message's error") or None
            if metadata is not None:
                changes["metadata"] = to_json(merged(json.loads(row["metadata"]), metadata),
                                              "Message metadata")
            assignments = ", ".join(f"{column} = ?" for column in changes)
            conn.execute(f"UPDATE messages SET {assignments} WHERE id = ?",
                         (*changes.values(), message_id))
            conn.execute("UPDATE chats SET updated_at = ? WHERE id = ?",
                         (changes["updated_at"], row["chat_id"]))
            return self._load(conn, message_id)

    def get_message(self, message_id: int) -> Message:
        with self._read() as conn:
            return self._load(conn, message_id)

    def active_path(self, chat_id: int) -> list[Message]:
        """The branch shown: messages from the root down to the chat's head ([] if empty)."""
        with self._read() as conn:
            head = self._chat_row(conn, chat_id)["head_message_id"]
            rows = conn.execute(
                """WITH RECURSIVE path(id, depth) AS (
                       SELECT ?, 0
                       UNION ALL
                       SELECT m.parent_id, path.depth + 1 FROM messages m JOIN path ON m.id = path.id
                       WHERE m.parent_id IS NOT NULL)
                   SELECT messages.* FROM path JOIN messages USING (id) ORDER BY depth DESC""",
                (head,)).fetchall()
            return self._with_attachments(conn, rows)

    def chat_messages(self, chat_id: int) -> list[Message]:
        """Every message of the chat, all branches, in order of creation (parents first)."""
        with self._read() as conn:
            self._chat_row(conn, chat_id)
            rows = conn.execute("SELECT * FROM messages WHERE chat_id = ? ORDER BY id",
                                (chat_id,)).fetchall()
            return self._with_attachments(conn, rows)

    def versions(self, message_id: int) -> Versions:
        """The versions of a message (its siblings of the same role, itself included)."""
        with self._read() as conn:
            row = self._message_row(conn, message_id)
            rows = conn.execute(
                "SELECT * FROM messages WHERE chat_id = ? AND parent_id IS ? AND role = ? ORDER BY id",
                (row["chat_id"], row["parent_id"], row["role"])).fetchall()
            messages = self._with_attachments(conn, rows)
            index = next(i for i, m in enumerate(messages) if m.id == message_id)
            return Versions(messages=tuple(messages), index=index)

    def version_places(self, chat_id: int) -> dict[int, tuple[int, int]]:
        """Message id -> (index among its versions, how many), for every message of the chat
        in one read: what `versions` says one message at a time (opening a long chat asked
        it per message, ~600 queries)."""
        with self._read() as conn:
            self._chat_row(conn, chat_id)
            rows = conn.execute("SELECT id, parent_id, role FROM messages WHERE chat_id = ? "
                                "ORDER BY id", (chat_id,)).fetchall()
        groups: dict[tuple[int | None, str], list[int]] = {}
        for row in rows:
            groups.setdefault((row["parent_id"], row["role"]), []).append(row["id"])
        return {message_id: (index, len(ids))
                for ids in groups.values() for index, message_id in enumerate(ids)}

    def switch_version(self, message_id: int) -> Chat:
        """Show the branch through `message_id`: the head becomes the most recently created
        leaf below it (or the message itself if it has no replies)."""
        with self._write() as conn:
            chat_id = self._message_row(conn, message_id)["chat_id"]
            leaf = conn.execute(
                """WITH RECURSIVE below(id) AS (
                       SELECT ?
                       UNION ALL
                       SELECT m.id FROM messages m JOIN below ON m.parent_id = below.id)
                   SELECT id FROM below
                   WHERE NOT EXISTS (SELECT 1 FROM messages c WHERE c.parent_id = below.id)
                   ORDER BY id DESC LIMIT 1""",
                (message_id,)).fetchone()[0]
            self._set_head(conn, chat_id, leaf, touch=False)
            return chat_from_row(self._chat_row(conn, chat_id))

    def mark_interrupted(self) -> int:
        """Call once at start-up: replies left 'streaming' by a crashed or killed run become
        'interrupted', their text kept. Returns how many there were."""
        with self._write() as conn:
            cursor = conn.execute(
                "UPDATE messages SET status = 'interrupted', updated_at = ? WHERE status = 'streaming'",
                (self._now(),))
            return cursor.rowcount

    # -- helpers (the caller holds the lock, inside _read or _write) --

    def _insert(self, conn: sqlite3.Connection, chat_id: int, parent_id: int | None, role: str,
                content: str, status: str, attachments: Iterable[NewAttachment | Attachment],
                metadata: Mapping[str, Any] | None, error: str | None) -> int:
        now = self._now()
        cursor = conn.execute(
            """INSERT INTO messages (chat_id, parent_id, role, content, status, error,
                                     created_at, updated_at, metadata)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (chat_id, parent_id, check_role(role), check_text(content, "A message's content"),
             check_status(status), error or None, now, now,
             to_json(metadata or {}, "Message metadata")))
        message_id = cursor.lastrowid
        conn.executemany(
            """INSERT INTO attachments (message_id, name, kind, text, token_count, size_bytes, sha256)
               VALUES (?, ?, ?, ?, ?, ?, ?)""",
            [(message_id, *check_attachment(a)) for a in attachments])
        return message_id

    def _set_head(self, conn: sqlite3.Connection, chat_id: int, message_id: int, *, touch: bool) -> None:
        if touch:
            conn.execute("UPDATE chats SET head_message_id = ?, updated_at = ? WHERE id = ?",
                         (message_id, self._now(), chat_id))
        else:
            conn.execute("UPDATE chats SET head_message_id = ? WHERE id = ?", (message_id, chat_id))

    def _message_row(self, conn: sqlite3.Connection, message_id: int) -> sqlite3.Row:
        row = conn.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise StorageError(f"There is no message with id {message_id}.")
        return row

    def _load(self, conn: sqlite3.Connection, message_id: int) -> Message:
        return self._with_attachments(conn, [self._message_row(conn, message_id)])[0]

    def _with_attachments(self, conn: sqlite3.Connection, rows: list[sqlite3.Row]) -> list[Message]:
        ids = [row["id"] for row in rows]
        found: dict[int, list[Attachment]] = {}
        for start in range(0, len(ids), _SQL_ID_CHUNK):
            chunk = ids[start:start + _SQL_ID_CHUNK]
            marks = ", ".join("?" * len(chunk))
            for a in conn.execute(f"SELECT * FROM attachments WHERE message_id IN ({marks}) ORDER BY id", chunk):
                found.setdefault(a["message_id"], []).append(attachment_from_row(a))
        return [message_from_row(row, tuple(found.get(row["id"], ()))) for row in rows]
