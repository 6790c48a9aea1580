"""A chat's documents: whole in the prompt, or searched (issue 14). Qt-free.

The window asks it
  - whether a dropped document should be indexed (`should_index`, with the context budget's
    `reply_room`),
  - which of a conversation's documents are searched (`searched_sources`),
  - how many passages a question gets (`passages_that_fit`),
  - how retrieved passages are kept with a reply (`passages_to_metadata` and back).

A chat's mode (its setting "documents"): "auto" searches the documents that do not fit the
context, "whole" always puts them whole, "search" always indexes them. A searched
attachment carries its file's sha256 (the index's key); its text stays with the message, but
the model sees only the passages retrieved for each question. The passages a reply was given
are saved in that reply's metadata, so the conversation's earlier turns are rebuilt exactly
(the prefix cache then still matches them) and the reply's citations resolve after a restart.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.retrieval.index import StoredPassage
from app.retrieval.library import Retrieved
from app.retrieval.passages import Passage

MODE_KEY = "documents"  # the chat setting
MODES = {"auto": "Automatic: search documents that do not fit",
         "whole": "Always put documents in whole",
         "search": "Always search documents (retrieval with citations)"}
PASSAGES_KEY = "passages"  # in a reply's metadata
PASSAGES_PER_QUESTION = 5
# A passage is about 200 of the encoder's word pieces (app/retrieval/library.ENCODER_ID); in
# a chat model's tokens, with its header line, rarely more than this.
PASSAGE_TOKENS = 300


def chat_mode(settings: dict | None) -> str:
    mode = (settings or {}).get(MODE_KEY, "auto")
    return mode if mode in MODES else "auto"


def should_index(mode: str, conversation_tokens: int, document_tokens: int, context: int,
                 reply_room: int) -> bool:
    """Whether a chat in `mode` searches documents of `document_tokens` (those attached
    now, together) rather than sending them whole after `conversation_tokens`."""
    if mode == "whole":
        return False
    if mode == "search":
        return True
    return conversation_tokens + document_tokens + reply_room > context


def passages_that_fit(context: int, conversation_tokens: int, reply_room: int) -> int:
    """How many passages a question gets: PASSAGES_PER_QUESTION, fewer when the context
    has no room for them after the conversation and the reply, never none."""
    room = context - conversation_tokens - reply_room
    return max(1, min(PASSAGES_PER_QUESTION, room // PASSAGE_TOKENS))


def is_searched(attachment, mode: str) -> bool:
    return bool(getattr(attachment, "sha256", None)) and mode != "whole"


def searched_sources(path: Sequence, mode: str) -> list[tuple[str, str]]:
    """(sha256, name) of the searched documents attached anywhere in the conversation, once
    each, in order: a follow-up question searches every one of them."""
    seen: dict[str, str] = {}
    for message in path:
        if message.role == "user":
            for a in message.attachments:
                if is_searched(a, mode):
                    seen.setdefault(a.sha256, a.name)
    return list(seen.items())


def search_question(message) -> str:
    """What to search for: the question, or (a document sent alone) its names."""
    text = message.content.strip()
    return text or "Summarise " + ", ".join(a.name for a in message.attachments)


def passages_to_metadata(retrieved: Sequence[Retrieved]) -> list[dict]:
    return [{"number": r.number, "id": r.passage.id, "document_id": r.passage.document_id,
             "file": r.passage.document_name, "index": r.passage.passage.index,
             "page": r.passage.passage.page, "heading": r.passage.passage.heading,
             "text": r.passage.passage.text, "score": round(float(r.score), 6)}
            for r in retrieved]


def passages_from_metadata(metadata: dict | None) -> list[Retrieved]:
    """The passages saved with a reply (malformed entries skipped)."""
    out = []
    for item in (metadata or {}).get(PASSAGES_KEY) or []:
        try:
            passage = Passage(int(item.get("index", 0)), str(item["text"]), item.get("page"),
                              item.get("heading"))
            stored = StoredPassage(int(item.get("id", 0)), int(item.get("document_id", 0)),
                                   str(item.get("file", "")), passage)
            out.append(Retrieved(int(item["number"]), stored, float(item.get("score", 0.0))))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out
