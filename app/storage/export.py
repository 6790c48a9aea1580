"""Chats out and in: Markdown (to read or share) and JSON (a full, re-importable copy).

The JSON form holds the whole message tree -- every version of every message -- with
settings and attachments. Message ids in it are only references within the file (a
message's `parent` names an earlier message's `id`); importing gives everything new ids.
"""

from __future__ import annotations

import re
from typing import Any

from app.storage.chats import DEFAULT_TITLE, ChatStore
from app.storage.errors import StorageError
from app.storage.records import Chat, Message, NewAttachment
from app.storage.validate import (check_attachment, check_generation_settings, check_role,
                                  check_status, check_text, merged, to_json)

FORMAT = "ferrox-chat"
FORMAT_VERSION = 1

_ROLE_HEADINGS = {"system": "System", "user": "User", "assistant": "Assistant"}
_STATUS_NOTES = {"stopped": "stopped by the user", "interrupted": "interrupted",
                 "streaming": "still being written"}


def export_markdown(store: ChatStore, chat_id: int) -> str:
    """The chat as shown (the active branch) as Markdown: title, then each message under a
    heading for its role, attachments listed by name."""
    chat = store.get_chat(chat_id)
    parts = [f"# {chat.title}"]
    system_prompt = chat.settings.get("system_prompt")
    if system_prompt:
        parts.append(f"*System prompt:* {system_prompt}")
    for message in store.active_path(chat_id):
        parts.extend(_markdown_message(message))
    return "\n\n".join(parts) + "\n"


def _markdown_message(message: Message) -> list[str]:
    parts = [f"## {_ROLE_HEADINGS[message.role]}", _markdown_body(message.content)]
    if message.attachments:
        parts.append("Attachments: " + ", ".join(a.name for a in message.attachments))
    if message.status == "error":
        parts.append(f"*(error: {message.error or 'unknown'})*")
    elif message.status in _STATUS_NOTES:
        parts.append(f"*({_STATUS_NOTES[message.status]})*")
    return parts


_FENCE_LINE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_ROLE_HEADING = re.compile(r"^ {0,3}## (System|User|Assistant)\s*$", re.MULTILINE)


def _markdown_body(content: str) -> str:
    """`content` as it is when it is self-contained Markdown; otherwise (a code fence left
    open, or a line that reads as one of our role headings) fenced verbatim, with a fence of
    more backticks than any run inside (CommonMark: only a fence at least as long closes
    it), so it cannot swallow what follows and its text comes back exactly."""
    if not _leaves_fence_open(content) and not _ROLE_HEADING.search(content):
        return content
    longest = max((len(run) for run in re.findall(r"`+", content)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{content}\n{fence}"


def _leaves_fence_open(content: str) -> bool:
    """Whether a fenced code block opened in `content` is still open at its end."""
    opening = None  # (character, length) of the open fence
    for line in content.splitlines():
        match = _FENCE_LINE.match(line)
        if match is None:
            continue
        run, rest = match.group(1), match.group(2)
        if opening is None:
            if not (run[0] == "`" and "`" in rest):  # a backtick fence's info has no backtick
                opening = (run[0], len(run))
        elif run[0] == opening[0] and len(run) >= opening[1] and not rest.strip():
            opening = None
    return opening is not None


def export_json(store: ChatStore, chat_id: int) -> dict[str, Any]:
    """The whole chat as JSON-ready data: every message of every branch, settings, model,
    attachments and which branch was shown; `import_json` reads it back."""
    chat = store.get_chat(chat_id)
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "chat": {"title": chat.title, "created_at": chat.created_at, "updated_at": chat.updated_at,
                 "pinned": chat.pinned, "model": chat.model, "settings": chat.settings,
                 "head": chat.head_message_id},
        "messages": [_json_message(m) for m in store.chat_messages(chat_id)],
    }


def _json_message(message: Message) -> dict[str, Any]:
    return {"id": message.id, "parent": message.parent_id, "role": message.role,
            "content": message.content, "status": message.status, "error": message.error,
            "created_at": message.created_at, "updated_at": message.updated_at,
            "metadata": message.metadata,
            "attachments": [{"name": a.name, "kind": a.kind, "text": a.text,
                             "token_count": a.token_count, "size_bytes": a.size_bytes}
                            for a in message.attachments]}


def import_json(store: ChatStore, data: Any) -> Chat:
    """Add the chat in `data` (from `export_json`) as a new chat, all or nothing. Bad input is
    refused with a StorageError saying what is wrong; nothing is saved then. A reply that was
    still streaming when exported comes in as 'interrupted'."""
    chat, messages = _checked_export(data)
    with store.transaction():
        new = store.create_chat(chat["title"], chat["settings"], chat["model"])
        new_ids: dict[Any, int] = {}
        for m in messages:
            new_ids[m["id"]] = store.add_message(
                new.id, m["role"], m["content"], parent_id=new_ids.get(m["parent"]),
                status=m["status"], attachments=m["attachments"], metadata=m["metadata"],
                error=m["error"]).id
        if chat["head"] is not None:
            store.switch_version(new_ids[chat["head"]])
        if chat["pinned"]:
            store.set_pinned(new.id, True)
    return store.get_chat(new.id)


def _checked_export(data: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(chat fields, messages) from export data, or a StorageError naming the first problem."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StorageError("This is not a Ferrox Chat export (its \"format\" is not \"ferrox-chat\").")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StorageError("This Ferrox Chat export has no valid \"version\".")
    if version > FORMAT_VERSION:
        raise StorageError(f"This chat was exported by a newer Ferrox Chat (export version {version}; "
                           f"this version reads up to {FORMAT_VERSION}). Update Ferrox Chat to import it.")
    raw_chat, raw_messages = data.get("chat"), data.get("messages")
    if not isinstance(raw_chat, dict) or not isinstance(raw_messages, list):
        raise StorageError("This Ferrox Chat export lacks its \"chat\" or \"messages\" section.")
    messages = []
    seen: set[Any] = set()
    for number, raw in enumerate(raw_messages, start=1):
        try:
            message = _checked_message(raw, seen)
        except StorageError as error:
            raise StorageError(f"Message {number} of the export is not valid: {error}") from None
        seen.add(message["id"])
        messages.append(message)
    return _checked_chat(raw_chat, seen), messages


def _checked_chat(raw: dict[str, Any], message_ids: set[Any]) -> dict[str, Any]:
    title = raw.get("title")
    model = raw.get("model")
    head = raw.get("head")
    if model is not None and not isinstance(model, str):
        raise StorageError("The export's chat model must be text.")
    if head is not None and head not in message_ids:
        raise StorageError(f"The export's chat head {head!r} is not one of its messages.")
    return {"title": title if isinstance(title, str) and title.strip() else DEFAULT_TITLE,
            "settings": merged({}, check_generation_settings(raw.get("settings"))),
            "model": model, "head": head, "pinned": raw.get("pinned") is True}


def _checked_message(raw: Any, earlier_ids: set[Any]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise StorageError("it is not a JSON object.")
    message_id, parent = raw.get("id"), raw.get("parent")
    if not isinstance(message_id, (int, str)) or isinstance(message_id, bool) or message_id in earlier_ids:
        raise StorageError("its id is missing or repeated.")
    if parent is not None and parent not in earlier_ids:
        raise StorageError(f"its parent {parent!r} is not an earlier message.")
    status = check_status(raw.get("status", "complete"))
    error = raw.get("error")
    if error is not None:
        check_text(error, "Its error")
    metadata = raw.get("metadata") or {}
    to_json(metadata, "Its metadata")
    attachments = raw.get("attachments") or []
    if not isinstance(attachments, list):
        raise StorageError("its attachments are not a list.")
    return {"id": message_id, "parent": parent, "role": check_role(raw.get("role")),
            "content": check_text(raw.get("content"), "Its content"),
            "status": "interrupted" if status == "streaming" else status,
            "error": error, "metadata": metadata,
            "attachments": [_checked_attachment(a) for a in attachments]}


def _checked_attachment(raw: Any) -> NewAttachment:
    if not isinstance(raw, dict):
        raise StorageError("one of its attachments is not a JSON object.")
    attachment = NewAttachment(name=raw.get("name"), kind=raw.get("kind"), text=raw.get("text", ""),
                               token_count=raw.get("token_count", 0), size_bytes=raw.get("size_bytes", 0))
    check_attachment(attachment)
    return attachment
