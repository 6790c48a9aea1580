"""Split a document's text into passages for retrieval, each keeping its place.

Passages follow the text's own structure: a Markdown heading (or a PDF page marker
`--- Page N ---`, as app.documents writes them) starts a new section -- never a line inside a
fenced code block, nor any line of a document that is not prose (source code, where "# ..."
is a comment: the caller says, `headings=False`) --, paragraphs (blank-line
separated) are packed into passages of about `target_tokens`, and a passage carries the last
`overlap_tokens` of the previous one in the same section, so an answer that straddles a
boundary is still found whole. A paragraph longer than a passage is cut at sentence ends,
then at word boundaries.

Token counts come from the caller (the sentence encoder's word pieces), so passages fit the
encoder's input.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_PAGE = re.compile(r"^--- Page (\d+) ---$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Passage:
    index: int  # order within the document
    text: str
    page: int | None  # PDFs: the page the passage starts on
    heading: str | None  # the nearest heading above it

    @property
    def place(self) -> str:
        parts = []
        if self.page is not None:
            parts.append(f"page {self.page}")
        if self.heading:
            parts.append(f"“{self.heading}”")
        return ", ".join(parts)


@dataclass
class _Block:
    text: str
    page: int | None
    heading: str | None
    is_heading: bool = False  # the heading line itself


def _blocks(text: str, headings: bool = True) -> list[_Block]:
    """Paragraphs with the page and heading in force where each starts; headings themselves
    become one-line paragraphs so the passage keeps them. Inside a fenced code block (and
    everywhere without `headings`) a "# ..." line is text, not a heading."""
    page: int | None = None
    heading: str | None = None
    blocks: list[_Block] = []
    lines: list[str] = []
    fenced = False

    def flush() -> None:
        if lines:
            body = "\n".join(lines).strip()
            if body:
                blocks.append(_Block(body, page, heading))
            lines.clear()

    for line in text.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        elif m := _PAGE.match(line.strip()):
            flush()
            page = int(m.group(1))
            continue
        elif headings and not fenced and (m := _HEADING.match(line)):
            flush()
            heading = m.group(2).strip()
            blocks.append(_Block(line.strip(), page, heading, is_heading=True))
            continue
        if not line.strip():
            flush()
            continue
        lines.append(line)
    flush()
    return blocks


def _pieces(text: str, limit: int, count: Callable[[str], int]) -> list[str]:
    """`text` cut into pieces of at most `limit` tokens: at sentence ends, else words."""
    if count(text) <= limit:
        return [text]
    out: list[str] = []
    current = ""
    for unit in _SENTENCE_END.split(text):
        units = [unit] if count(unit) <= limit else unit.split()
        for u in units:
            candidate = f"{current} {u}".strip()
            if current and count(candidate) > limit:
                out.append(current)
                current = u
            else:
                current = candidate
    if current:
        out.append(current)
    return out


def split_passages(text: str, count_tokens: Callable[[str], int], target_tokens: int = 200,
                   overlap_tokens: int = 40, headings: bool = True) -> list[Passage]:
    """`headings`: whether "# ..." lines outside code fences are Markdown headings (prose);
    False for source code and data, whose "#" lines are comments."""
    if target_tokens <= overlap_tokens:
        raise ValueError("passages must be longer than their overlap")
    passages: list[Passage] = []
    current: list[tuple[str, bool]] = []  # (piece, is a heading line)
    size = 0
    place: tuple[int | None, str | None] = (None, None)
    fresh = False  # `current` holds text no passage has yet (not only the carried tail)

    def emit() -> None:
        nonlocal current, size, fresh
        if fresh and any(not heading for _, heading in current):
            passages.append(Passage(len(passages), "\n\n".join(c for c, _ in current), *place))
        # Carry the last `overlap_tokens` of this passage into the next (same section only).
        words = "\n\n".join(c for c, heading in current if not heading).split()
        k = min(len(words), overlap_tokens)
        while k > 0 and count_tokens(" ".join(words[-k:])) > overlap_tokens:
            k = k * 3 // 4
        tail = " ".join(words[-k:]) if k else ""
        current, size = ([(tail, False)], count_tokens(tail)) if tail else ([], 0)
        fresh = False

    for block in _blocks(text, headings):
        if (block.page, block.heading) != place and current:
            emit()
            current, size = [], 0  # no overlap across sections or pages
        if not current:
            place = (block.page, block.heading)
        for piece in _pieces(block.text, target_tokens - overlap_tokens, count_tokens):
            n = count_tokens(piece)
            if current and size + n > target_tokens:
                emit()
                if not current:
                    place = (block.page, block.heading)
            current.append((piece, block.is_heading))
            size += n
            fresh = True
    emit()
    return passages
