"""Markdown shown in a QTextDocument that grows as a reply streams, re-rendering only its tail.

A streaming reply only ever gets longer. Re-rendering all of it on every update made the
GUI thread's work grow with the reply (parse, style, lay out everything, twice when the
layout also asks about a second width). Here the text is cut at "commit points": a blank
line, outside fenced code, followed by a complete line that starts a new top-level block
(not indented, not a list item). Markdown before such a point renders the same whatever
comes after it, so the part before the last commit point is rendered once and never
touched again; only the tail after it is removed and rendered anew on each update.

Shapes: `IncrementalMarkdown.show(text)` keeps `document` showing `text`; `_committed` is
the prefix of the text rendered for good, `_tail_at` the document position where the tail's
rendering starts (the end of the committed part's last block).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from app.ui.qt import QtGui

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# GitHub's dialect, with raw HTML shown as the text it is, as chat apps show a model's "<b>".
# Qt's importer would insert inline HTML as rich text, and inside a list item that loses the
# list: the next item is no longer listed, with the warning "attempted to insert into a
# list that no longer exists" (Gemma 3 270M's "* <b>Q4 2022</b>" lists).
MARKDOWN_FEATURES = (QtGui.QTextDocument.MarkdownFeature.MarkdownDialectGitHub
                     | QtGui.QTextDocument.MarkdownFeature.MarkdownNoHTML)
_LIST_ITEM = re.compile(r"^([-+*]|\d{1,9}[.)])(\s|$)")


def commit_point(text: str, start: int = 0) -> int:
    """The last commit point in `text` at or after `start` (itself a commit point, or 0):
    the index of a complete line that follows a blank line outside fenced code and starts a
    top-level block. `start` when there is none. Costs the length of `text[start:]`."""
    point, fence, previous_blank, after_code = start, None, False, False
    position = start
    while True:
        end = text.find("\n", position)
        if end < 0:
            return point  # the last line may still grow: never a commit point
        line = text[position:end]
        if fence is not None:
            match = _FENCE.match(line)
            if match and line.strip() == match.group(1) and match.group(1)[0] == fence[0] \
                    and len(match.group(1)) >= len(fence):
                fence, after_code = None, True
            previous_blank = False
        else:
            # Not right after fenced code: its frame's folding reaches into the next block.
            if (previous_blank and position > start and line and not line[0].isspace()
                    and not after_code
                    and not _LIST_ITEM.match(line) and not line.startswith(("[", "<", "|"))):
                point = position
            match = _FENCE.match(line)
            if match:
                fence = match.group(1)
            previous_blank = not line.strip()
            if line.strip():
                after_code = False
        position = end + 1


class IncrementalMarkdown:
    """Keeps `document` showing a Markdown text; `prepare(markdown)` turns a piece of the
    text into what Qt's importer reads, `style(document, from_position)` styles what was
    just inserted (code frames)."""

    def __init__(self, document: QtGui.QTextDocument, prepare: Callable[[str], str],
                 style: Callable[[QtGui.QTextDocument, int], None]):
        self.document = document
        self._prepare = prepare
        self._style = style
        self._text: str | None = None
        self._committed = ""
        self._tail_at = 0
        document.setUndoRedoEnabled(False)  # edits are ours: an undo stack only grows

    @property
    def text(self) -> str | None:
        return self._text

    def reset(self) -> None:
        """Forget what is shown: the next `show` renders everything."""
        self._text = None
        self._committed = ""

    def show(self, text: str) -> None:
        if text == self._text:
            return
        if self._text is None or not text.startswith(self._committed):
            self._restart()
        point = commit_point(text, len(self._committed))
        cursor = QtGui.QTextCursor(self.document)
        cursor.beginEditBlock()
        cursor.setPosition(self._tail_at)
        cursor.movePosition(QtGui.QTextCursor.MoveOperation.End,
                            QtGui.QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        if point > len(self._committed):  # more of the text is final now: render it once
            self._insert(cursor, text[len(self._committed):point])
            self._committed = text[:point]
            self._tail_at = self.document.characterCount() - 1
        self._insert(cursor, text[point:])
        cursor.endEditBlock()
        self._text = text

    def _restart(self) -> None:
        self.document.clear()
        self._committed = ""
        self._tail_at = 0

    def _insert(self, cursor: QtGui.QTextCursor, markdown: str) -> None:
        """Render `markdown` as whole blocks after the document's end (the cursor's place)."""
        if not markdown.strip():
            return
        start = cursor.position()
        if self.document.isEmpty():  # the first piece: exactly what a full render does
            self.document.setMarkdown(self._prepare(markdown), MARKDOWN_FEATURES)
            self._style(self.document, 0)
            cursor.movePosition(QtGui.QTextCursor.MoveOperation.End)
            return
        piece = QtGui.QTextDocument()
        piece.setDefaultFont(self.document.defaultFont())
        piece.setMarkdown(self._prepare(markdown), MARKDOWN_FEATURES)
        # insertFragment() merges the piece's first block into the block at the cursor, which
        # keeps its own format: lead the piece with an empty plain block, so each of its real
        # blocks arrives whole, with its format and list. (Splitting at the start moves the
        # content into a new block with the format given.)
        first = piece.begin()
        lead = QtGui.QTextCursor(piece)
        lead.insertBlock(first.blockFormat(), first.charFormat())
        lead.movePosition(QtGui.QTextCursor.MoveOperation.Start)
        lead.setBlockFormat(QtGui.QTextBlockFormat())  # this also takes it out of any list
        cursor.insertFragment(QtGui.QTextDocumentFragment(piece))
        self._style(self.document, start)
        cursor.movePosition(QtGui.QTextCursor.MoveOperation.End)
