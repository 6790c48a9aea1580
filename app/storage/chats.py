"""`ChatStore`: the one object the GUI and the CLI use for chats, messages, models and settings.

Chats are listed pinned first, then by `updated_at` (the last change to the chat's messages,
title, settings or model; pinning, deleting and restoring leave it alone, so undo puts a chat
back where it was). Deleting is soft: a deleted chat keeps everything and can be restored
until `purge_deleted` removes it for good.
"""

from __future__ import annotations

from typing import Any, Mapping

from app.storage.app_settings import AppSettings
from app.storage.errors import StorageError
from app.storage.messages import MessageTree
from app.storage.model_registry import ModelRegistry
from app.storage.records import Chat, chat_from_row
from app.storage.validate import check_generation_settings, merged, to_json

DEFAULT_TITLE = "New chat"


class ChatStore(MessageTree, ModelRegistry, AppSettings):
    """Chats, their message trees, added models and app settings, in one SQLite database.

    Safe to share between threads (see `app.storage.base`); every call that writes has
    committed when it returns. Everything returned is a frozen record. Every failure is a
    StorageError with a plain message."""

    def create_chat(self, title: str = DEFAULT_TITLE, settings: Mapping[str, Any] | None = None,
                    model: str | None = None) -> Chat:
        settings = merged({}, check_generation_settings(settings))
        with self._write() as conn:
            now = self._now()
            cursor = conn.execute(
                "INSERT INTO chats (title, created_at, updated_at, model, settings) VALUES (?, ?, ?, ?, ?)",
                (_checked_title(title), now, now, _checked_model(model), to_json(settings, "Chat settings")))
            return chat_from_row(self._chat_row(conn, cursor.lastrowid))

    def get_chat(self, chat_id: int) -> Chat:
        """The chat, deleted or not; StorageError if there is none with this id."""
        with self._read() as conn:
            return chat_from_row(self._chat_row(conn, chat_id))

    def list_chats(self, query: str = "") -> list[Chat]:
        """Chats not deleted, pinned first, then most recently updated. A non-empty `query`
        keeps those whose title or any message (any branch) contains it, ignoring case."""
        query = query.strip()
        where = "deleted_at IS NULL"
        if query:
            contains, needle = _contains(query)
            where += (f" AND ({contains.format('title')} OR EXISTS (SELECT 1 FROM messages m"
                      f" WHERE m.chat_id = chats.id AND {contains.format('m.content')}))")
        with self._read() as conn:
            rows = conn.execute(f"SELECT * FROM chats WHERE {where} "
                                "ORDER BY pinned DESC, updated_at DESC, id DESC",
                                {"q": needle} if query else {}).fetchall()
            return [chat_from_row(row) for row in rows]

    def rename_chat(self, chat_id: int, title: str) -> Chat:
        return self._update_chat(chat_id, touch=True, title=_checked_title(title))

    def set_pinned(self, chat_id: int, pinned: bool) -> Chat:
        return self._update_chat(chat_id, touch=False, pinned=int(bool(pinned)))

    def set_chat_model(self, chat_id: int, model: str | None) -> Chat:
        return self._update_chat(chat_id, touch=True, model=_checked_model(model))

    def update_chat_settings(self, chat_id: int, changes: Mapping[str, Any]) -> Chat:
        """Merge `changes` into the chat's settings; a None value drops a key (back to the
        default). Known keys (temperature, top_p, ...) are checked loosely."""
        changes = check_generation_settings(changes)
        with self._write() as conn:
            current = chat_from_row(self._chat_row(conn, chat_id)).settings
            return self._update_chat(chat_id, touch=True,
                                     settings=to_json(merged(current, changes), "Chat settings"))

    def delete_chat(self, chat_id: int) -> Chat:
        """Soft delete: hidden from `list_chats`, kept for `restore_chat` (undo)."""
        with self._write() as conn:
            if self._chat_row(conn, chat_id)["deleted_at"] is not None:
                return chat_from_row(self._chat_row(conn, chat_id))
            return self._update_chat(chat_id, touch=False, deleted_at=self._now())

    def restore_chat(self, chat_id: int) -> Chat:
        return self._update_chat(chat_id, touch=False, deleted_at=None)

    def list_deleted_chats(self) -> list[Chat]:
        """The Trash: deleted chats, most recently deleted first."""
        with self._read() as conn:
            rows = conn.execute("SELECT * FROM chats WHERE deleted_at IS NOT NULL "
                                "ORDER BY deleted_at DESC, id DESC").fetchall()
            return [chat_from_row(row) for row in rows]

    def purge_chat(self, chat_id: int) -> None:
        """Remove one deleted chat for good (messages and attachments too). A chat that is
        not in the Trash is refused, so a slip cannot destroy a live chat."""
        with self._write() as conn:
            if self._chat_row(conn, chat_id)["deleted_at"] is None:
                raise StorageError("Only a chat in the Trash can be deleted for good.")
            conn.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def purge_deleted(self, older_than_s: float = 0.0) -> int:
        """Remove for good the chats deleted at least `older_than_s` seconds ago, with their
        messages and attachments. Returns how many chats went."""
        with self._write() as conn:
            cursor = conn.execute("DELETE FROM chats WHERE deleted_at IS NOT NULL AND deleted_at <= ?",
                                  (self._now() - older_than_s,))
            return cursor.rowcount

    def _update_chat(self, chat_id: int, *, touch: bool, **columns: Any) -> Chat:
        with self._write() as conn:
            self._chat_row(conn, chat_id)
            if touch:
                columns["updated_at"] = self._now()
            assignments = ", ".join(f"{column} = ?" for column in columns)
            conn.execute(f"UPDATE chats SET {assignments} WHERE id = ?", (*columns.values(), chat_id))
            return chat_from_row(self._chat_row(conn, chat_id))


def _contains(query: str) -> tuple[str, str]:
    """(SQL with `{}` for a column, value for `:q`): the column contains `query`, ignoring
    case. SQLite's LIKE folds ASCII only, so other queries go through Python's casefold
    (scanning 20k messages on the dev machine: LIKE ~7 ms, casefold ~40 ms)."""
    if query.isascii():
        escaped = query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return "{} LIKE :q ESCAPE '\\'", f"%{escaped}%"
    return "instr(casefold({}), :q) > 0", query.casefold()


def _checked_title(title: Any) -> str:
    if not isinstance(title, str) or not title.strip():
        raise StorageError("A chat title cannot be empty.")
    return " ".join(title.split())  # one line: newlines and runs of spaces become one space


def _checked_model(model: Any) -> str | None:
    if model is not None and not isinstance(model, str):
        raise StorageError(f"A chat's model must be text or None, not {type(model).__name__}.")
    return model or None
