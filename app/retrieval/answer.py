"""Questions answered from retrieved passages: the prompt that numbers them, and the
citations ([1], [2], ...) read back out of the reply."""

from __future__ import annotations

import re
from collections.abc import Sequence

from app.retrieval.library import Retrieved

_CITATION = re.compile(r"\[(\d{1,3})\]")

INSTRUCTIONS = ("Answer the question using only the numbered passages below. After each fact, "
                "cite the passage it comes from like [1]. If the passages do not contain the "
                "answer, say so.")


def passages_block(retrieved: Sequence[Retrieved]) -> str:
    parts = []
    for r in retrieved:
        place = r.passage.passage.place
        where = f"{r.passage.document_name}" + (f", {place}" if place else "")
        parts.append(f"[{r.number}] ({where})\n{r.passage.passage.text}")
    return "\n\n".join(parts)


def question_prompt(question: str, retrieved: Sequence[Retrieved]) -> str:
    """The user turn: instructions, the numbered passages, then the question."""
    return f"{INSTRUCTIONS}\n\n{passages_block(retrieved)}\n\nQuestion: {question}"


def cited_numbers(reply: str, retrieved: Sequence[Retrieved]) -> list[int]:
    """The passage numbers the reply cites, in order of first citation, that exist."""
    valid = {r.number for r in retrieved}
    seen: dict[int, None] = {}
    for m in _CITATION.finditer(reply):
        n = int(m.group(1))
        if n in valid:
            seen.setdefault(n)
    return list(seen)
