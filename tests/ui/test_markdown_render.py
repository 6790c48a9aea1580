"""Incremental Markdown: a growing text renders as a full render would, and an update
touches only the document after the part already final."""

from __future__ import annotations

import pytest

from app.ui.markdown_render import MARKDOWN_FEATURES, IncrementalMarkdown, commit_point
from app.ui.message_view import style_code, with_line_breaks
from app.ui.qt import QtGui, QtWidgets

REPLY = ("# Title\n\nFirst para with **bold**.\nsecond line\n\n- x\n- y\n\n"
         "```python\nprint(1)\n\nprint(2)\n```\n\nAfter the code.\n\n1. one\n\n2. two\n\n"
         "Para with `code` and [a link](https://example.com).\n\n> quote\n\n"
         "    indented code\n\nThe end *here*.")


def test_commit_points_are_blank_lines_before_a_new_top_level_block():
    text = "One.\n\nTwo.\n\n- a\n\n- b\n\n```\nx\n\ny\n```\n\nThree.\n\nFour"
    # Not after fenced code (its frame folds into the next block), so at the fence here.
    assert text[commit_point(text):].startswith("```\nx")
    assert commit_point("One.\n\n- a\n\n- b\n") == 0  # items may still join the list
    assert commit_point("One.\n\nTwo") == 0  # an unfinished line is never one
    assert "One.\n\nTwo.\n"[commit_point("One.\n\nTwo.\n"):] == "Two.\n"
    inside = "Text\n\n```\ncode\n\nmore code\n"
    assert commit_point(inside) == inside.index("```")  # not inside fenced code
    assert commit_point("Para\n\n    indented\n") == 0  # belongs to what comes before
    assert commit_point("A\n\nB\n\nC\n", start=3) == 6


def _full(text: str, palette) -> QtGui.QTextDocument:
    document = QtGui.QTextDocument()
    document.setMarkdown(with_line_breaks(text), MARKDOWN_FEATURES)
    style_code(document, palette)
    return document


def _shape(document: QtGui.QTextDocument) -> list[tuple]:
    """What a person sees of each block: text, heading, list and number, code, spacing."""
    shape, block = [], document.begin()
    while block.isValid():
        fmt, listed = block.blockFormat(), block.textList()
        in_frame = QtGui.QTextCursor(block).currentFrame() is not document.rootFrame()
        shape.append((block.text(), fmt.headingLevel(), fmt.topMargin(), fmt.bottomMargin(),
                      listed.format().style() if listed else None,
                      listed.itemNumber(block) if listed else None, in_frame))
        block = block.next()
    return [row for row in shape if row[0] or row[6]]  # zero-height empty blocks aside


@pytest.fixture
def palette(qapp):
    return QtWidgets.QApplication.palette()


def test_a_streamed_text_ends_up_rendered_as_a_full_render(palette):
    document = QtGui.QTextDocument()
    render = IncrementalMarkdown(document, with_line_breaks,
                                 lambda doc, at: style_code(doc, palette, at))
    for end in range(1, len(REPLY) + 1, 7):
        render.show(REPLY[:end])
        if REPLY[end - 1] == "\n":  # whole lines: compare with a full render
            assert _shape(document) == _shape(_full(REPLY[:end], palette)), REPLY[:end]
    render.show(REPLY)
    assert _shape(document) == _shape(_full(REPLY, palette))
    assert document.toPlainText() == _full(REPLY, palette).toPlainText()


def test_an_update_changes_only_the_unfinished_tail(palette):
    document = QtGui.QTextDocument()
    render = IncrementalMarkdown(document, with_line_breaks,
                                 lambda doc, at: style_code(doc, palette, at))
    document.documentLayout()  # as a shown document has (Qt reports changes to its layout)
    changes = []
    document.contentsChange.connect(lambda at, removed, added: changes.append(at))
    text = "".join(f"Paragraph {n} says something.\n\n" for n in range(40))
    render.show(text)
    first_block = document.begin().text()
    changes.clear()
    render.show(text + "A new paragraph is being writ")
    finished = document.find("Paragraph 38").position()
    assert changes and min(changes) > finished  # paragraphs 0..38 were not touched
    assert document.begin().text() == first_block
    assert document.toPlainText().endswith("Paragraph 39 says something.\nA new paragraph is being writ")


def test_a_changed_beginning_renders_everything_again(palette):
    document = QtGui.QTextDocument()
    render = IncrementalMarkdown(document, with_line_breaks,
                                 lambda doc, at: style_code(doc, palette, at))
    render.show("One.\n\nTwo.\n\nThree")
    render.show("Other.\n\nText")
    assert document.toPlainText() == "Other.\nText"


def test_raw_html_shows_as_text_and_keeps_a_list_whole(palette):
    # A list whose items hold inline HTML (Gemma 3 270M wrote "* <b>Q4 2022</b>"): rendered
    # as Qt's importer renders HTML, the second item fell out of the list, with a Qt warning
    # (which fails this test: qt_log_level_fail).
    text = "Quarters:\n\n* <b>Q4 2022</b>\n* <b>Q4 2021</b>\n* <i>Q4</i> <br> 2020\n"
    document = QtGui.QTextDocument()
    render = IncrementalMarkdown(document, with_line_breaks,
                                 lambda doc, at: style_code(doc, palette, at))
    for end in range(1, len(text) + 1):
        render.show(text[:end])
    listed = [row for row in _shape(document) if row[4] is not None]
    assert [row[0] for row in listed] == ["<b>Q4 2022</b>", "<b>Q4 2021</b>", "<i>Q4</i> <br> 2020"]
    assert [row[5] for row in listed] == [0, 1, 2]  # (0-based) one list, in order
