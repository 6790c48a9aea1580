"""ComposerPanel: Enter/Shift+Enter/Esc, sending rules, busy state, attachment chips and
dropped files."""

from __future__ import annotations

import pytest

from app.ui.composer import MAX_VISIBLE_LINES, ComposerPanel, chip_text
from app.ui.qt import QtCore, QtGui, QtWidgets, Qt
from app.ui.view_models import AttachmentChip


@pytest.fixture
def panel(qtbot):
    # Hosted in a plain window without a layout: as a top-level of its own, the panel's size
    # constraints would reach the offscreen platform plugin, which warns it cannot apply them.
    host = QtWidgets.QWidget()
    qtbot.addWidget(host)
    host.resize(600, 200)
    widget = ComposerPanel(host)
    widget.resize(600, 200)
    host.show()
    qtbot.waitExposed(host)
    yield widget  # the generator keeps `host` (and so the panel) alive during the test


def find(panel, name, kind=QtWidgets.QWidget):
    return panel.findChild(kind, name)


def type_text(qtbot, panel, text):
    qtbot.keyClicks(find(panel, "composer"), text)


def test_widgets_are_findable_by_object_name(panel):
    assert isinstance(find(panel, "composer"), QtWidgets.QPlainTextEdit)
    assert find(panel, "sendButton").text() == "Send"
    assert find(panel, "stopButton").text() == "Stop"
    assert find(panel, "attachButton").toolTip() == "Attach a document"
    assert find(panel, "attachmentList") is not None
    assert "Enter to send" in find(panel, "composer").placeholderText()


def test_enter_sends_the_trimmed_text(panel, qtbot):
    type_text(qtbot, panel, "  hello there ")
    with qtbot.waitSignal(panel.sendRequested) as blocker:
        qtbot.keyClick(find(panel, "composer"), Qt.Key.Key_Return)
    assert blocker.args == ["hello there"]
    assert panel.text() == "  hello there "  # the controller clears it once accepted


def test_send_button_sends(panel, qtbot):
    panel.set_text("from the button")
    with qtbot.waitSignal(panel.sendRequested) as blocker:
        qtbot.mouseClick(find(panel, "sendButton"), Qt.MouseButton.LeftButton)
    assert blocker.args == ["from the button"]


def test_shift_enter_starts_a_new_line(panel, qtbot):
    edit = find(panel, "composer")
    with qtbot.assertNotEmitted(panel.sendRequested):
        qtbot.keyClicks(edit, "one")
        qtbot.keyClick(edit, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
        qtbot.keyClicks(edit, "two")
    assert panel.text() == "one\ntwo"


def test_escape_stops(panel, qtbot):
    panel.set_busy(True)
    with qtbot.waitSignal(panel.stopRequested):
        qtbot.keyClick(find(panel, "composer"), Qt.Key.Key_Escape)
    with qtbot.waitSignal(panel.stopRequested):
        qtbot.mouseClick(find(panel, "stopButton"), Qt.MouseButton.LeftButton)


@pytest.mark.parametrize("text", ["", "   \n  "])
def test_empty_input_is_not_sent(panel, qtbot, text):
    panel.set_text(text)
    with qtbot.assertNotEmitted(panel.sendRequested):
        qtbot.keyClick(find(panel, "composer"), Qt.Key.Key_Return)
        qtbot.mouseClick(find(panel, "sendButton"), Qt.MouseButton.LeftButton)


def test_empty_text_is_sent_when_documents_are_attached(panel, qtbot):
    panel.set_attachments([AttachmentChip("k1", "report.pdf", 120)])
    with qtbot.waitSignal(panel.sendRequested) as blocker:
        qtbot.keyClick(find(panel, "composer"), Qt.Key.Key_Return)
    assert blocker.args == [""]


def test_busy_shows_stop_instead_of_send(panel, qtbot):
    send, stop = find(panel, "sendButton"), find(panel, "stopButton")
    assert send.isVisible() and not stop.isVisible()
    panel.set_busy(True)
    assert stop.isVisible() and stop.isEnabled() and not send.isVisible()
    panel.set_text("queued thought")
    with qtbot.assertNotEmitted(panel.sendRequested):
        qtbot.keyClick(find(panel, "composer"), Qt.Key.Key_Return)
    panel.set_busy(False)
    assert send.isVisible() and not stop.isVisible()


def test_send_can_be_refused_with_a_reason(panel, qtbot):
    panel.set_send_enabled(False, "Load a model first")
    send = find(panel, "sendButton")
    assert not send.isEnabled() and send.toolTip() == "Load a model first"
    panel.set_text("hello")
    with qtbot.assertNotEmitted(panel.sendRequested):
        qtbot.keyClick(find(panel, "composer"), Qt.Key.Key_Return)
    panel.set_send_enabled(True)
    with qtbot.waitSignal(panel.sendRequested):
        qtbot.keyClick(find(panel, "composer"), Qt.Key.Key_Return)


def test_text_helpers(panel):
    panel.set_text("draft")
    assert panel.text() == "draft"
    panel.clear_text()
    assert panel.text() == ""
    panel.focus_input()


def test_the_box_grows_with_its_text_up_to_a_limit(panel, qtbot):
    edit = find(panel, "composer")
    one_line = edit.height()
    panel.set_text("a\nb\nc")
    qtbot.waitUntil(lambda: edit.height() > one_line)
    three_lines = edit.height()
    assert edit.verticalScrollBar().maximum() == 0
    panel.set_text("\n".join(f"line {n}" for n in range(40)))
    qtbot.waitUntil(lambda: edit.visible_lines() == MAX_VISIBLE_LINES)
    assert three_lines < edit.height() < 40 * edit.fontMetrics().lineSpacing()


def test_attach_button(panel, qtbot):
    with qtbot.waitSignal(panel.attachRequested):
        qtbot.mouseClick(find(panel, "attachButton"), Qt.MouseButton.LeftButton)


# -- attachment chips ------------------------------------------------------------------

def test_chip_text():
    assert chip_text(AttachmentChip("k", "report.pdf", 1234)) == "report.pdf · 1,234 tokens"
    assert chip_text(AttachmentChip("k", "a.txt", 1)) == "a.txt · 1 token"
    assert chip_text(AttachmentChip("k", "big.docx", None)) == "big.docx · counting…"


def test_chips_show_and_can_be_removed(panel, qtbot):
    strip = find(panel, "attachmentList")
    assert not strip.isVisible()
    panel.set_attachments([AttachmentChip("k1", "report.pdf", 1234),
                           AttachmentChip("k2", "book.docx", None, warning="2,300 tokens over")])
    assert strip.isVisible()
    first, second = strip.chips()
    assert first.label.text() == "report.pdf · 1,234 tokens" and not first.warning.isVisible()
    assert second.warning.isVisible() and second.warning.text() == "2,300 tokens over"
    with qtbot.waitSignal(panel.attachmentRemoved) as blocker:
        qtbot.mouseClick(second.remove_button, Qt.MouseButton.LeftButton)
    assert blocker.args == ["k2"]
    panel.set_attachments([])
    assert not strip.isVisible() and strip.chips() == []


# -- dropped files ---------------------------------------------------------------------

def file_mime(*urls: QtCore.QUrl) -> QtCore.QMimeData:
    mime = QtCore.QMimeData()
    mime.setUrls(list(urls))
    return mime


def drag_event(kind, mime: QtCore.QMimeData):
    # Qt 6: drag enter/move events take a QPoint, a drop event a QPointF.
    point = QtCore.QPointF(20, 20) if kind is QtGui.QDropEvent else QtCore.QPoint(20, 20)
    return kind(point, Qt.DropAction.CopyAction, mime,
                Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)


def test_dropping_files_emits_their_local_paths(panel, qtbot, tmp_path):
    paths = [str(tmp_path / "a.pdf"), str(tmp_path / "b.txt")]
    mime = file_mime(*map(QtCore.QUrl.fromLocalFile, paths), QtCore.QUrl("https://example.com"))
    # Dragged over the message box: the panel takes the files, they are not pasted as text.
    target = find(panel, "composer").viewport()
    enter = drag_event(QtGui.QDragEnterEvent, mime)
    QtWidgets.QApplication.sendEvent(target, enter)
    assert enter.isAccepted()
    drop = drag_event(QtGui.QDropEvent, mime)
    with qtbot.waitSignal(panel.filesDropped) as blocker:
        QtWidgets.QApplication.sendEvent(target, drop)
    assert blocker.args == [paths]
    assert drop.isAccepted() and panel.text() == ""


def test_only_drags_with_local_files_are_accepted(panel, tmp_path):
    def accepted(mime):
        event = drag_event(QtGui.QDragEnterEvent, mime)
        QtWidgets.QApplication.sendEvent(panel, event)
        return event.isAccepted()

    text = QtCore.QMimeData()
    text.setText("just text")
    assert accepted(file_mime(QtCore.QUrl.fromLocalFile(str(tmp_path / "a.pdf"))))
    assert not accepted(text)
    assert not accepted(file_mime(QtCore.QUrl("https://example.com")))
