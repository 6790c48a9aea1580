"""Chats in: a JSON export (from `export_json`) read, checked against its schema, and added as
a new chat in one transaction.

Two steps, so the slow one can run off the GUI thread:

    export = read_chat_export(path)        # file -> checked ChatExport; no database, any thread
    chat = add_chat_export(store, export)  # one transaction; all or nothing

`import_chat_file(store, path)` does both; the store is thread-safe, so a worker thread may
call it. Every refusal is a `ChatImportError` (a StorageError) whose message says what is wrong
in plain words; nothing is saved then and existing chats are never touched.

Limits are stated up front (`ImportLimits`): the file's size is checked before a byte is read,
JSON nesting is bounded (deep nesting would otherwise raise RecursionError while parsing or
saving), and every field has an explicit type and size check -- ids must be numbers or short
text, since an id that is a list cannot even be looked up.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.storage.chats import DEFAULT_TITLE, ChatStore
from app.storage.errors import StorageError
from app.storage.export import FORMAT, FORMAT_VERSION
from app.storage.records import ROLES, STATUSES, Chat, NewAttachment
from app.storage.validate import check_generation_settings, merged, to_json

_MAX_INT = (1 << 63) - 1  # SQLite's INTEGER


class ChatImportError(StorageError):
    """A chat export cannot be imported; `str(error)` says why. Nothing was saved."""


@dataclass(frozen=True)
class ImportLimits:
    """What an import accepts. The defaults hold any chat Ferrox Chat itself can export."""

    max_file_bytes: int = 64 * 1024 * 1024
    max_messages: int = 100_000
    max_text_chars: int = 4_000_000  # one message's content, error or attachment text
    max_name_chars: int = 1_000  # titles, model names, attachment names and kinds, ids
    max_depth: int = 32  # JSON nesting anywhere in the file (an export needs about 6)


@dataclass(frozen=True)
class ChatExport:
    """A checked export: chat fields and messages in file order (parents come first).

    `chat`: title, settings, model, head (a message id or None), pinned.
    `messages`: dicts with id, parent, role, content, status, error, metadata, attachments."""

    chat: dict[str, Any]
    messages: list[dict[str, Any]]


def import_chat_file(store: ChatStore, path: str | os.PathLike, *,
                     limits: ImportLimits = ImportLimits()) -> Chat:
    """Read, check and add the chat exported to `path`; ChatImportError if it cannot be.

    Safe to call from a worker thread (the GUI must not call it on its own thread: a large
    file takes seconds to parse)."""
    return add_chat_export(store, read_chat_export(path, limits=limits))


def import_json(store: ChatStore, data: Any, *, limits: ImportLimits = ImportLimits()) -> Chat:
    """Add the chat in already-parsed export `data` as a new chat, all or nothing. A reply
    that was still streaming when exported comes in as 'interrupted'."""
    return add_chat_export(store, check_chat_export(data, limits=limits))


def read_chat_export(path: str | os.PathLike, *, limits: ImportLimits = ImportLimits()) -> ChatExport:
    """The checked export in the file at `path`. Touches no database."""
    return check_chat_export(_parse_json(_read_bounded(Path(path), limits.max_file_bytes)),
                             limits=limits)


def add_chat_export(store: ChatStore, export: ChatExport) -> Chat:
    """Add a checked export as a new chat in one transaction and return it."""
    chat = export.chat
    with store.transaction():
        new = store.create_chat(chat["title"], chat["settings"], chat["model"])
        new_ids: dict[Any, int] = {}
        for m in export.messages:
            new_ids[m["id"]] = store.add_message(
                new.id, m["role"], m["content"], parent_id=new_ids.get(m["parent"]),
                status=m["status"], attachments=m["attachments"], metadata=m["metadata"],
                error=m["error"]).id
        if chat["head"] is not None:
            store.switch_version(new_ids[chat["head"]])
        if chat["pinned"]:
            store.set_pinned(new.id, True)
    return store.get_chat(new.id)


# ---- the file --------------------------------------------------------------------------


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise ChatImportError("It is a folder, not a chat export file.")
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read forever
            raise ChatImportError("It is not a regular file.")
        if info.st_size > max_bytes:
            raise ChatImportError(_too_large(info.st_size, max_bytes))
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)  # +1: a file that grew since stat() is still caught
    except OSError as error:
        raise ChatImportError(f"The file cannot be read ({error.strerror or error}).") from None
    if len(data) > max_bytes:
        raise ChatImportError(_too_large(len(data), max_bytes))
    return data


def _too_large(size: int, limit: int) -> str:
    return (f"The file is {size / 2**20:,.1f} MB; chat exports up to "
            f"{limit / 2**20:,.0f} MB can be imported.")


def _parse_json(data: bytes) -> Any:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ChatImportError("It is not a Ferrox Chat export (the file is not UTF-8 text).") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ChatImportError("It is not a valid chat export: its JSON is nested too deeply.") from None
    except json.JSONDecodeError as error:
        raise ChatImportError(f"It is not a valid JSON file ({error.msg} at line {error.lineno}, "
                              f"column {error.colno}).") from None


def _refuse_constant(name: str) -> Any:
    raise ChatImportError(f"It is not a valid chat export: it contains {name}, which JSON "
                          "numbers cannot be.")


# ---- the schema --------------------------------------------------------------------------


def check_chat_export(data: Any, *, limits: ImportLimits = ImportLimits()) -> ChatExport:
    """The checked form of parsed export data, or a ChatImportError naming the first problem."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ChatImportError("This is not a Ferrox Chat export (its \"format\" is not \"ferrox-chat\").")
    version = data.get("version")
    if not _is_int(version) or version < 1:
        raise ChatImportError("This Ferrox Chat export has no valid \"version\".")
    if version > FORMAT_VERSION:
        raise ChatImportError(
            f"This chat was exported by a newer Ferrox Chat (export version {version}; this "
            f"version reads up to {FORMAT_VERSION}). Update Ferrox Chat to import it.")
    _check_depth(data, limits.max_depth)
    raw_chat, raw_messages = data.get("chat"), data.get("messages")
    if not isinstance(raw_chat, dict) or not isinstance(raw_messages, list):
        raise ChatImportError("This Ferrox Chat export lacks its \"chat\" or \"messages\" section.")
    if len(raw_messages) > limits.max_messages:
        raise ChatImportError(f"The export has {len(raw_messages):,} messages; at most "
                              f"{limits.max_messages:,} can be imported.")
    checker = _Checker(limits)
    messages = []
    seen: set[int | str] = set()
    for number, raw in enumerate(raw_messages, start=1):
        try:
            message = checker.message(raw, seen)
        except StorageError as error:
            raise ChatImportError(f"Message {number} of the export is not valid: {error}") from None
        seen.add(message["id"])
        messages.append(message)
    try:
        chat = checker.chat(raw_chat, seen)
    except StorageError as error:
        raise ChatImportError(f"The export's chat is not valid: {error}") from None
    return ChatExport(chat, messages)


def _check_depth(value: Any, max_depth: int) -> None:
    """Refuse JSON nested deeper than `max_depth` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise ChatImportError(f"It is not a valid chat export: its JSON is nested more "
                                      f"than {max_depth} levels deep.")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


class _Checker:
    """Field-by-field checks; each failure is a StorageError with a short reason."""

    def __init__(self, limits: ImportLimits):
        self.limits = limits

    def chat(self, raw: dict[str, Any], message_ids: set[int | str]) -> dict[str, Any]:
        title = self.optional_text(raw.get("title"), "its title", self.limits.max_name_chars)
        model = self.optional_text(raw.get("model"), "its model", self.limits.max_name_chars)
        head = raw.get("head")
        if head is not None and (not self.is_id(head) or head not in message_ids):
            raise StorageError(f"its head {_short(head)} is not one of its messages.")
        pinned = raw.get("pinned")
        if pinned is not None and not isinstance(pinned, bool):
            raise StorageError("\"pinned\" must be true or false.")
        self.optional_times(raw)
        settings = check_generation_settings(raw.get("settings"), "Its settings")
        self.strings_encodable(settings, "its settings")
        self.optional_text(settings.get("system_prompt"), "its system prompt", self.limits.max_text_chars)
        return {"title": title if title and title.strip() else DEFAULT_TITLE,
                "settings": merged({}, settings),
                "model": model, "head": head, "pinned": pinned is True}

    def message(self, raw: Any, earlier_ids: set[int | str]) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise StorageError("it is not a JSON object.")
        message_id, parent = raw.get("id"), raw.get("parent")
        if not self.is_id(message_id) or message_id in earlier_ids:
            raise StorageError("its id is missing, repeated, or not a number or short text.")
        if parent is not None and (not self.is_id(parent) or parent not in earlier_ids):
            raise StorageError(f"its parent {_short(parent)} is not an earlier message.")
        role, status = raw.get("role"), raw.get("status", "complete")
        if not isinstance(role, str) or role not in ROLES:
            raise StorageError(f"its role must be one of {', '.join(ROLES)}, not {_short(role)}.")
        if not isinstance(status, str) or status not in STATUSES:
            raise StorageError(f"its status must be one of {', '.join(STATUSES)}, not {_short(status)}.")
        metadata = raw.get("metadata")
        if metadata is None:
            metadata = {}
        to_json(metadata, "Its metadata")
        self.strings_encodable(metadata, "its metadata")
        attachments = raw.get("attachments")
        if attachments is None:
            attachments = []
        if not isinstance(attachments, list):
            raise StorageError("its attachments are not a list.")
        self.optional_times(raw)
        return {"id": message_id, "parent": parent, "role": role,
                "content": self.text(raw.get("content"), "its content", self.limits.max_text_chars),
                "status": "interrupted" if status == "streaming" else status,
                "error": self.optional_text(raw.get("error"), "its error", self.limits.max_text_chars),
                "metadata": metadata,
                "attachments": [self.attachment(a) for a in attachments]}

    def attachment(self, raw: Any) -> NewAttachment:
        if not isinstance(raw, dict):
            raise StorageError("one of its attachments is not a JSON object.")
        name = self.text(raw.get("name"), "an attachment's name", self.limits.max_name_chars)
        if not name.strip():
            raise StorageError("one of its attachments has no name.")
        kind = self.text(raw.get("kind"), f"the kind of attachment {name!r}", self.limits.max_name_chars)
        text = self.text(raw.get("text", ""), f"the text of attachment {name!r}", self.limits.max_text_chars)
        counts = raw.get("token_count", 0), raw.get("size_bytes", 0)
        if not all(_is_int(n) and 0 <= n <= _MAX_INT for n in counts):
            raise StorageError(f"attachment {name!r}: token_count and size_bytes must be whole "
                               "numbers, 0 or more.")
        sha256 = raw.get("sha256")
        if sha256 is not None and not (isinstance(sha256, str) and len(sha256) == 64
                                       and all(c in "0123456789abcdef" for c in sha256)):
            raise StorageError(f"attachment {name!r}: sha256 must be 64 lowercase hex digits.")
        return NewAttachment(name=name, kind=kind, text=text, token_count=counts[0],
                             size_bytes=counts[1], sha256=sha256)

    def is_id(self, value: Any) -> bool:
        if isinstance(value, str):
            return 0 < len(value) <= self.limits.max_name_chars
        return _is_int(value) and abs(value) <= _MAX_INT

    def text(self, value: Any, what: str, max_chars: int) -> str:
        if not isinstance(value, str):
            raise StorageError(f"{what} must be text, not {_kind(value)}.")
        if len(value) > max_chars:
            raise StorageError(f"{what} is {len(value):,} characters long; the limit is {max_chars:,}.")
        if not _encodable(value):
            raise StorageError(f"{what} contains a broken character (an unpaired UTF-16 surrogate).")
        return value

    def optional_text(self, value: Any, what: str, max_chars: int) -> str | None:
        return None if value is None else self.text(value, what, max_chars)

    def optional_times(self, raw: dict[str, Any]) -> None:
        # Not imported (the new chat gets new times), but a wrong type means a damaged file.
        for key in ("created_at", "updated_at"):
            value = raw.get(key)
            if value is not None and not (_is_number(value)):
                raise StorageError(f"\"{key}\" must be a number of seconds, not {_kind(value)}.")

    def strings_encodable(self, value: Any, what: str) -> None:
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if not _encodable(item):
                    raise StorageError(f"{what} contains a broken character (an unpaired UTF-16 surrogate).")
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) and abs(value) <= _MAX_INT) or (isinstance(value, float) and math.isfinite(value))


def _encodable(text: str) -> bool:
    """Whether SQLite can store `text` (JSON allows lone surrogates such as "\\ud800")."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", bool: "true/false", type(None): "null",
            int: "a number", float: "a number", str: "text"}.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else _kind(value)
    return text if len(text) <= 60 else text[:57] + "…"
