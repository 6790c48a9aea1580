"""Chats out: Markdown (to read or share) and JSON (a full, re-importable copy).

The JSON form holds the whole message tree -- every version of every message -- with
settings and attachments. Message ids in it are only references within the file (a
message's `parent` names an earlier message's `id`); importing (`importing.py`) gives
everything new ids.
"""

from __future__ import annotations

import re
from typing import Any

from app.storage.chats import ChatStore
from app.storage.records import Message

FORMAT = "ferrox-chat"
FORMAT_VERSION = 1

_ROLE_HEADINGS = {"system": "System", "user": "User", "assistant": "Assistant"}
_STATUS_NOTES = {"stopped": "stopped by the user", "interrupted": "interrupted",
                 "streaming": "still being written"}


def export_file_name(title: str, suffix: str) -> str:
    """A file name for a chat's export: its title with every character a file system may
    refuse (or that reads as a path) as "_", no "_" or space at either end (a title cut with
    "…" once gave "Write a long story about a_.md"), at most 60 characters, "chat" when
    nothing is left."""
    safe = re.sub(r"[^\w -]", "_", title).strip(" _")[:60].rstrip(" _")
    return f"{safe or 'chat'}{suffix}"


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
                             "token_count": a.token_count, "size_bytes": a.size_bytes,
                             **({"sha256": a.sha256} if a.sha256 else {})}
                            for a in message.attachments]}
