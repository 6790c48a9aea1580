"""While a reply streams, the window still takes what the person does: keys typed into the
composer and the wheel over the transcript go through the event loop (posted, as the
system delivers them) and are handled while the stream goes on. How fast is measured by
scripts/bench_gui_stalls.py, never asserted here."""

from __future__ import annotations

import pytest

from app.ui.qt import QtCore, QtGui, QtWidgets, Qt
from tests.ui.conftest import REPLY_TIMEOUT_MS


def _post_keys(widget: QtWidgets.QWidget, text: str) -> None:
    for char in text:
        for kind in (QtCore.QEvent.Type.KeyPress, QtCore.QEvent.Type.KeyRelease):
            QtWidgets.QApplication.postEvent(
                widget, QtGui.QKeyEvent(kind, 0, Qt.KeyboardModifier.NoModifier, char))


def _post_wheel_up(widget: QtWidgets.QWidget) -> None:
    at = QtCore.QPointF(widget.rect().center())
    QtWidgets.QApplication.postEvent(widget, QtGui.QWheelEvent(
        at, widget.mapToGlobal(at), QtCore.QPoint(0, 0), QtCore.QPoint(0, 120),
        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase,
        False))


@pytest.mark.slow
def test_keys_and_the_wheel_are_handled_while_a_reply_streams(driver, qtbot):
    controller, window, store = driver.controller, driver.window, driver.store
    chat = controller.current_chat_id
    with store.transaction():  # a history taller than the view, so there is room to scroll
        for i in range(24):
            store.add_message(chat, "user" if i % 2 == 0 else "assistant",
                              f"Message {i}\n\n" + "words " * 60)
    controller.show_chat(chat)
    window.resize(900, 700)
    window.show()
    qtbot.waitExposed(window)
    driver.set_max_tokens(400)
    driver.type_and_send("Once upon a time, by the sea,")
    reply = controller.replies.for_chat(chat)
    qtbot.waitUntil(lambda: reply.tokens >= 3, timeout=REPLY_TIMEOUT_MS)
    live = lambda: controller.replies.for_chat(chat) is reply  # noqa: E731

    edit = window.composer.edit
    edit.setFocus()
    _post_keys(edit, "next question")
    seen = []  # was the reply still streaming when the typed text had arrived?
    qtbot.waitUntil(lambda: edit.toPlainText() == "next question" and not seen.append(live()))
    assert seen[-1], "the reply ended before the keys were handled: nothing was shown"

    view = window.message_view
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    bottom = bar.value()
    _post_wheel_up(view.viewport())
    seen.clear()
    qtbot.waitUntil(lambda: bar.value() < bottom and not seen.append(live()))
    assert seen[-1], "the reply ended before the wheel was handled"
    scrolled, tokens = bar.value(), reply.tokens

    # The stream goes on below without pulling the view back down.
    qtbot.waitUntil(lambda: reply.tokens >= tokens + 5 or not live(), timeout=REPLY_TIMEOUT_MS)
    qtbot.waitUntil(lambda: view.message_widget(reply.message_id).body.markdown()
                    .strip() != "", timeout=REPLY_TIMEOUT_MS)
    assert bar.value() == scrolled
    assert edit.toPlainText() == "next question"  # the streaming never took the typed text
    controller.stop()
    driver.wait_until_idle()
