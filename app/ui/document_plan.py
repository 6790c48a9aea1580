"""The window's side of a chat's documents: citations as a reply shows them.

What a chat does with its documents (whole or searched, passages kept with a reply) and how a
conversation becomes the model's messages moved below the GUI, to app/chat/documents.py and
app/chat/prompt.py; their names are re-exported here for the window's modules.
"""

from __future__ import annotations

from app.chat.documents import (MODE_KEY, MODES, PASSAGE_TOKENS, PASSAGES_KEY,  # noqa: F401
                                PASSAGES_PER_QUESTION, chat_mode, is_searched,
                                passages_from_metadata, passages_that_fit, passages_to_metadata,
                                search_question, searched_sources, should_index)
from app.chat.prompt import prompt_messages  # noqa: F401
from app.ui.view_models import CitedPassage


# ---- citations in a reply ----------------------------------------------------------------

def cited_passages(metadata: dict | None) -> tuple[CitedPassage, ...]:
    """The passages saved with a reply, as its message shows them."""
    out = []
    for r in passages_from_metadata(metadata):
        place = r.passage.passage.place
        out.append(CitedPassage(r.number, r.passage.document_name + (f", {place}" if place else ""),
                                r.passage.passage.text))
    return tuple(out)
