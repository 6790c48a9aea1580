"""A conversation's stored path -> the messages the model reads. Qt-free, model-free.

The same path always gives the same messages, character for character, whatever happened in
between (a restart, another chat's reply, a model switch): turn N+1's prompt starts with turn
N's, so a prefix cache -- this computer's radix cache, or a server's (vLLM, SGLang, llama.cpp)
-- finds the whole earlier conversation. Nothing here reads the clock, the settings of the
moment or the model; a turn answered from passages is rebuilt from the passages saved with
its reply, never searched again.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from app.chat.documents import (chat_mode, is_searched, passages_from_metadata,
                                search_question)
from app.documents import Document, format_for_prompt
from app.models.chat_template import Message as PromptMessage
from app.retrieval.answer import question_prompt


def prompt_messages(system: str, path: Sequence, mode: str,
                    leave_out: int | None = None) -> list[PromptMessage]:
    """The conversation as the model reads it. Whole documents go before their message's
    text; a message answered from passages becomes the numbered-passages question (the
    passages saved with the reply after it). `leave_out`: the id of the reply being
    written (not part of its own prompt). A failed reply with no text is left out (there is
    nothing to read); one with partial text is part of the conversation, as shown."""
    messages = [PromptMessage("system", system)] if system else []
    for i, m in enumerate(path):
        if m.id == leave_out:
            continue
        if m.role == "assistant" and m.status == "error" and not m.content:
            continue
        content = m.content
        if m.role == "user":
            following = path[i + 1] if i + 1 < len(path) else None
            passages = (passages_from_metadata(following.metadata)
                        if following is not None and following.role == "assistant" else [])
            if passages:
                content = question_prompt(search_question(m), passages)
            docs = [format_for_prompt(Document(name=a.name, path=Path(a.name), kind=a.kind,
                                               text=a.text, size_bytes=a.size_bytes, pages=None))
                    for a in m.attachments if not is_searched(a, mode)]
            content = "\n\n".join(docs + ([content] if content else []))
        messages.append(PromptMessage(m.role, content))
    return messages


def chat_messages(chat, path: Sequence, leave_out: int | None = None) -> list[PromptMessage]:
    """`prompt_messages` with the chat's own system prompt and document mode (`chat`: a
    stored Chat)."""
    settings = chat.settings or {}
    return prompt_messages(settings.get("system_prompt", ""), path, chat_mode(settings), leave_out)
