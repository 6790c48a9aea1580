"""MessageView: showing chats, coalesced streaming updates, following the stream, and the
per-message actions (copy, copy code, regenerate, edit, versions)."""

from __future__ import annotations

import pytest

from app.ui import message_view
from app.ui.message_view import MessageView, MessageWidget, code_blocks
from app.ui.qt import QtCore, QtGui, QtWidgets, Qt
from app.ui.view_models import ERROR, PREFILLING, STOPPED, STREAMING, MessageItem

CODE_REPLY = "Here:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nDone."
TWO_BLOCKS = "```sh\npip install x\n```\n\nthen\n\n~~~python\nimport x\nx.run()\n~~~\n"


@pytest.fixture
def view(qtbot):
    widget = MessageView()
    qtbot.addWidget(widget)
    widget.resize(600, 400)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def user(message_id: int, text: str, **kw) -> MessageItem:
    return MessageItem(message_id, "user", text, **kw)


def assistant(message_id: int, text: str, **kw) -> MessageItem:
    return MessageItem(message_id, "assistant", text, **kw)


def long_chat(count: int = 12) -> list[MessageItem]:
    return [(user if i % 2 == 0 else assistant)(i, f"Message {i}\n\n" + "words " * 60)
            for i in range(count)]


# -- code blocks -----------------------------------------------------------------------

def test_code_blocks_finds_backtick_and_tilde_fences():
    assert code_blocks(CODE_REPLY) == ["def add(a, b):\n    return a + b"]
    assert code_blocks(TWO_BLOCKS) == ["pip install x", "import x\nx.run()"]
    assert code_blocks("no code, just `inline`") == []


def test_an_unclosed_fence_runs_to_the_end_while_streaming():
    assert code_blocks("Look:\n```python\nprint(1)\nprint(2") == ["print(1)\nprint(2"]


# -- showing messages ------------------------------------------------------------------

def test_set_messages_shows_each_message_with_its_role(view):
    view.set_messages([user(1, "Hello"), assistant(2, "**Hi** there")])
    assert view.message_ids() == [1, 2]
    first, second = view.message_widget(1), view.message_widget(2)
    assert first.role_label.text() == "You"
    assert second.role_label.text() == "Assistant"
    assert second.body.toPlainText() == "Hi there"  # Markdown rendered, not shown raw
    assert second.body.markdown() == "**Hi** there"


def test_set_messages_replaces_the_previous_chat(view, qtbot):
    view.set_messages([user(1, "old"), assistant(2, "old reply")])
    view.set_messages([user(7, "new")])
    assert view.message_ids() == [7]


def test_placeholder_only_for_an_empty_chat(view):
    view.set_placeholder("Start the conversation below")
    assert view.placeholder.isVisible()
    view.set_messages([user(1, "Hello")])
    assert not view.placeholder.isVisible()
    view.clear()
    assert view.message_ids() == []
    assert view.placeholder.isVisible()


def test_message_height_fits_its_document_and_refits_on_width_change(view, qtbot):
    view.set_messages([assistant(1, "word " * 300)])
    body = view.message_widget(1).body
    qtbot.waitUntil(lambda: body.verticalScrollBar().maximum() == 0)
    wide_height = body.height()
    assert wide_height >= body.document().size().height()
    view.resize(300, 400)
    qtbot.waitUntil(lambda: body.height() > wide_height)
    assert body.verticalScrollBar().maximum() == 0


def test_code_is_set_in_a_fixed_pitch_font(view):
    view.set_messages([assistant(1, CODE_REPLY)])
    document = view.message_widget(1).body.document()
    block = document.findBlock(document.toPlainText().index("def add"))
    assert block.charFormat().fontFixedPitch() or \
        QtGui.QTextCursor(block).charFormat().fontFixedPitch()


def test_progress_error_info_and_attachments_are_shown(view):
    view.set_messages([
        user(1, "Summarise", attachments=("report.pdf", "notes.txt")),
        assistant(2, "", status=PREFILLING, progress="Reading the prompt… 45%"),
        assistant(3, "", status=ERROR, error="Out of memory"),
        assistant(4, "Partial", status=STOPPED, info="12 tokens"),
    ])
    asked, waiting, failed, stopped = (view.message_widget(i) for i in (1, 2, 3, 4))
    assert "report.pdf" in asked.attachments.text() and "notes.txt" in asked.attachments.text()
    assert waiting.progress_box.isVisible()
    assert waiting.progress_label.text() == "Reading the prompt… 45%"
    assert not waiting.regenerate_button.isEnabled()  # it is still being written
    assert failed.error_box.isVisible() and failed.error_label.text() == "Out of memory"
    assert stopped.info.text() == "Stopped · 12 tokens"
    assert not stopped.progress_box.isVisible() and not stopped.error_box.isVisible()


def test_links_open_in_the_system_browser(view, monkeypatch):
    opened = []
    monkeypatch.setattr(QtGui.QDesktopServices, "openUrl", opened.append)
    view.set_messages([assistant(1, "See [the docs](https://example.com/docs).")])
    body = view.message_widget(1).body
    body.anchorClicked.emit(QtCore.QUrl("https://example.com/docs"))
    assert [url.toString() for url in opened] == ["https://example.com/docs"]
    assert body.markdown() == "See [the docs](https://example.com/docs)."  # still shown


def test_the_wheel_over_a_message_scrolls_the_transcript(view, qtbot):
    view.set_messages(long_chat())
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    body = view.message_widget(11).body
    position = QtCore.QPointF(body.viewport().rect().center())
    wheel = QtGui.QWheelEvent(position, body.viewport().mapToGlobal(position),
                              QtCore.QPoint(0, 0), QtCore.QPoint(0, 120),
                              Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier,
                              Qt.ScrollPhase.NoScrollPhase, False)
    QtWidgets.QApplication.sendEvent(body.viewport(), wheel)
    assert bar.value() < bar.maximum()


# -- streaming updates -----------------------------------------------------------------

def test_updates_are_coalesced_and_applied_on_the_timer(view, qtbot, monkeypatch):
    view.set_messages([user(1, "Count"), assistant(2, "", status=STREAMING)])
    applied = []
    real_apply = MessageWidget.apply
    monkeypatch.setattr(MessageWidget, "apply",
                        lambda self, item: (applied.append(item), real_apply(self, item)))
    text = ""
    for n in range(50):
        text += f"{n} "
        view.update_message(assistant(2, text, status=STREAMING))
    assert applied == []  # nothing is repainted per call
    widget = view.message_widget(2)
    qtbot.waitUntil(lambda: widget.body.markdown() == text)
    assert len(applied) == 1 and applied[0].text == text


def test_a_costly_stream_is_shown_less_often_but_at_least_about_fifteen_times_a_second(view):
    """The wait before the next update keeps showing streamed text near STREAM_CPU_SHARE of
    a core, from the update's own time plus the measuring and painting since the last one."""

    def wait_after(own_ms: float, render_ms: float) -> int:
        message_view.RENDER_METER.take()
        message_view.RENDER_METER._ms = render_ms
        view._pace(own_ms)
        return view._flush_timer.interval()

    assert wait_after(0.5, 0.0) == message_view.FLUSH_INTERVAL_MS  # cheap: at display pace
    assert wait_after(0.5, 2.5) == int(3.0 / message_view.STREAM_CPU_SHARE)  # 3 ms: 37 ms
    assert wait_after(0.5, 40.0) == message_view.SHARED_FLUSH_INTERVAL_MS  # never slower for that
    assert wait_after(30.0, 0.0) == 6 * 30  # an update that itself takes 30 ms waits 6x that
    assert wait_after(100.0, 0.0) == message_view.MAX_FLUSH_INTERVAL_MS
    assert message_view.RENDER_METER.take() == 0.0  # each update takes what was measured


def test_painting_and_measuring_message_text_is_metered(view, qtbot):
    view.set_messages([assistant(1, "word " * 200)])
    body = view.message_widget(1).body
    qtbot.waitUntil(lambda: body.verticalScrollBar().maximum() == 0)
    message_view.RENDER_METER.take()
    body.viewport().repaint()
    body.heightForWidth(body.width() - 37)  # a width it does not have: measured on a copy
    assert message_view.RENDER_METER.take() > 0.0


def test_other_widths_are_measured_on_a_copy_each_that_follows_the_stream(view, qtbot):
    """The layout asks a streaming message's height at widths it does not have (with and
    without the scroll bar) on every update: each width keeps its own copy, which lays out
    only what changed, and every height is a full render's."""
    view.set_messages([assistant(1, "", status=STREAMING)])
    body = view.message_widget(1).body
    widths = [body.width() - 2, body.width() - 14]
    text = ""
    for n in range(12):
        text += f"Line {n} of a poem that keeps growing, " * 3 + "\n"
        body.set_markdown(text)
        for width in widths:
            fresh = message_view.MarkdownBrowser()
            fresh.setFont(body.font())
            fresh.set_markdown(text)
            fresh.resize(width, 100)
            expected = fresh.heightForWidth(width + 1)  # a copy at exactly that text width
            fresh.deleteLater()
            assert body.heightForWidth(width + 1) == expected
    assert len(body._scratch) == message_view.SCRATCH_WIDTHS
    copies = dict(body._scratch)
    body.set_markdown(text + "more")
    body.heightForWidth(widths[0] + 1)
    body.heightForWidth(widths[1] + 1)
    assert body._scratch == copies  # the same copies, not made again
    body.heightForWidth(widths[0] - 50)  # a third width: the oldest copy goes
    assert len(body._scratch) == message_view.SCRATCH_WIDTHS


def test_update_for_a_new_id_appends_the_message(view, qtbot):
    view.set_messages([user(1, "Hi")])
    view.update_message(assistant(2, "", status=PREFILLING, progress="Reading… 10%"))
    qtbot.waitUntil(lambda: view.message_ids() == [1, 2])
    assert view.message_widget(2).progress_label.text() == "Reading… 10%"


def test_set_messages_drops_updates_not_yet_applied(view, qtbot):
    view.set_messages([user(1, "Hi")])
    view.update_message(assistant(2, "stale"))
    view.set_messages([user(9, "Other chat")])
    qtbot.wait(message_view.FLUSH_INTERVAL_MS * 3)
    assert view.message_ids() == [9]


def test_streaming_follows_the_bottom(view, qtbot):
    chat = long_chat()
    view.set_messages(chat)
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    before = bar.maximum()
    view.update_message(assistant(99, "streamed " * 300, status=STREAMING))
    qtbot.waitUntil(lambda: bar.maximum() > before and bar.value() == bar.maximum())


def test_streaming_leaves_a_scrolled_up_view_alone(view, qtbot):
    view.set_messages(long_chat())
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    bar.setValue(0)  # the top: every older message is built now
    qtbot.waitUntil(lambda: view.built_count() == 12)
    bar.setValue(10)
    before = bar.maximum()
    view.update_message(assistant(99, "streamed " * 300, status=STREAMING))
    qtbot.waitUntil(lambda: bar.maximum() > before)
    assert bar.value() == 10


# -- actions ---------------------------------------------------------------------------

def test_copy_puts_the_markdown_on_the_clipboard(view, qtbot):
    view.set_messages([assistant(1, CODE_REPLY)])
    with qtbot.waitSignal(view.copied) as copied:
        qtbot.mouseClick(view.message_widget(1).copy_button, Qt.MouseButton.LeftButton)
    assert QtGui.QGuiApplication.clipboard().text() == CODE_REPLY
    assert copied.args == ["Copied the message"]


def test_copy_code_with_one_block_copies_it(view, qtbot):
    view.set_messages([assistant(1, CODE_REPLY), assistant(2, "no code here")])
    assert not view.message_widget(2).copy_code_button.isVisible()
    button = view.message_widget(1).copy_code_button
    assert button.isVisible() and button.menu() is None
    with qtbot.waitSignal(view.copied) as copied:
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    assert QtGui.QGuiApplication.clipboard().text() == "def add(a, b):\n    return a + b"
    assert copied.args == ["Copied the code"]


def test_copy_code_with_several_blocks_offers_a_menu(view, qtbot):
    view.set_messages([assistant(1, TWO_BLOCKS)])
    menu = view.message_widget(1).copy_code_button.menu()
    actions = menu.actions()
    assert [a.text() for a in actions] == ["1. pip install x", "2. import x"]
    with qtbot.waitSignal(view.copied):
        actions[1].trigger()
    assert QtGui.QGuiApplication.clipboard().text() == "import x\nx.run()"


def test_regenerate_is_offered_on_replies_and_edit_on_questions(view, qtbot):
    view.set_messages([user(1, "Q"), assistant(2, "A")])
    asked, answered = view.message_widget(1), view.message_widget(2)
    assert asked.edit_button.isVisible() and not asked.regenerate_button.isVisible()
    assert answered.regenerate_button.isVisible() and not answered.edit_button.isVisible()
    with qtbot.waitSignal(view.regenerateRequested) as blocker:
        qtbot.mouseClick(answered.regenerate_button, Qt.MouseButton.LeftButton)
    assert blocker.args == [2]


def test_version_switcher(view, qtbot):
    view.set_messages([assistant(1, "only"), assistant(2, "v2", version_index=1, version_count=3)])
    assert not view.message_widget(1).version_label.isVisible()
    widget = view.message_widget(2)
    assert widget.version_label.isVisible() and widget.version_label.text() == "2/3"
    with qtbot.waitSignal(view.versionRequested) as blocker:
        qtbot.mouseClick(widget.prev_button, Qt.MouseButton.LeftButton)
    assert blocker.args == [2, -1]
    with qtbot.waitSignal(view.versionRequested) as blocker:
        qtbot.mouseClick(widget.next_button, Qt.MouseButton.LeftButton)
    assert blocker.args == [2, 1]
    view.update_message(assistant(2, "v3", version_index=2, version_count=3))
    qtbot.waitUntil(lambda: widget.version_label.text() == "3/3")
    assert widget.prev_button.isEnabled() and not widget.next_button.isEnabled()


def test_edit_then_save_and_send(view, qtbot):
    view.set_messages([user(1, "Wrong question"), assistant(2, "A")])
    widget = view.message_widget(1)
    qtbot.mouseClick(widget.edit_button, Qt.MouseButton.LeftButton)
    assert widget.editing and widget.editor.isVisible() and not widget.body.isVisible()
    assert widget.editor.toPlainText() == "Wrong question"
    widget.editor.setPlainText("  Right question \n")
    with qtbot.waitSignal(view.editRequested) as blocker:
        qtbot.mouseClick(widget.save_edit_button, Qt.MouseButton.LeftButton)
    assert blocker.args == [1, "Right question"]
    assert not widget.editing and widget.body.isVisible()


def test_edit_cancel_restores_the_message(view, qtbot):
    view.set_messages([user(1, "Question")])
    widget = view.message_widget(1)
    qtbot.mouseClick(widget.edit_button, Qt.MouseButton.LeftButton)
    widget.editor.setPlainText("changed")
    with qtbot.assertNotEmitted(view.editRequested):
        qtbot.mouseClick(widget.cancel_edit_button, Qt.MouseButton.LeftButton)
    assert not widget.editing
    assert widget.body.isVisible() and widget.body.markdown() == "Question"
    assert widget.edit_button.isVisible() and widget.copy_button.isVisible()


def test_an_emptied_edit_cannot_be_sent(view, qtbot):
    view.set_messages([user(1, "Question")])
    widget = view.message_widget(1)
    qtbot.mouseClick(widget.edit_button, Qt.MouseButton.LeftButton)
    widget.editor.setPlainText("   ")
    assert not widget.save_edit_button.isEnabled()


def test_edit_keys_enter_saves_and_escape_cancels(view, qtbot):
    view.set_messages([user(1, "Question")])
    widget = view.message_widget(1)
    widget.start_editing()
    qtbot.keyClicks(widget.editor, " again")
    with qtbot.waitSignal(view.editRequested) as blocker:
        qtbot.keyClick(widget.editor, Qt.Key.Key_Return)
    assert blocker.args == [1, "Question again"]
    widget.start_editing()
    with qtbot.assertNotEmitted(view.editRequested):
        qtbot.keyClick(widget.editor, Qt.Key.Key_Escape)
    assert not widget.editing


# -- line breaks -------------------------------------------------------------------------

HAIKU = "Waves fold into foam\nthe lighthouse counts the long night\nsalt on the window"


@pytest.mark.parametrize("role", ["user", "assistant"])
def test_single_newlines_are_line_breaks_outside_code(view, role):
    text = HAIKU + "\n\n```\nkeep  this\nas code\n```\nafter the code\nnext line"
    view.set_messages([MessageItem(1, role, text)])
    body = view.message_widget(1).body
    shown = body.toPlainText()
    assert "Waves fold into foam\nthe lighthouse counts the long night\nsalt on the window" in shown
    assert "after the code\nnext line" in shown
    assert "keep  this\nas code" in shown  # code keeps its lines and spaces, gets nothing added
    assert body.markdown() == text  # Copy gives the text as written


def test_line_breaks_leave_lists_and_headings_alone():
    from app.ui.message_view import with_line_breaks

    assert with_line_breaks("# Title\nfirst\nsecond") == "# Title  \nfirst  \nsecond"
    assert with_line_breaks("a\n\nb") == "a\n\nb"
    assert with_line_breaks("x\n```\ny\nz\n```") == "x\n```\ny\nz\n```"


# -- reasoning models ----------------------------------------------------------------------

def test_thinking_is_collapsed_above_the_answer_and_opens_on_click(view, qtbot):
    from app.ui.reasoning_view import split_reply

    item = split_reply(assistant(1, "<think>\nThe user wants a colour.\n</think>\n\nBlue."),
                       thinking_s=3.2)
    assert (item.text, item.reasoning, item.reasoning_label) == (
        "Blue.", "The user wants a colour.", "Thought for 3 s")
    view.set_messages([item])
    widget = view.message_widget(1)
    assert widget.body.toPlainText() == "Blue."
    assert not widget.reasoning_toggle.isHidden() and widget.reasoning_body.isHidden()
    qtbot.mouseClick(widget.reasoning_toggle, Qt.LeftButton)
    assert not widget.reasoning_body.isHidden()
    assert widget.reasoning_body.toPlainText() == "The user wants a colour."


def test_a_reply_still_thinking_says_so_and_a_plain_reply_has_no_toggle(view):
    from app.ui.reasoning_view import split_reply

    live = split_reply(assistant(1, "<think>Hmm, let me see", status=STREAMING), thinking_s=None)
    assert live.reasoning_label == "Thinking…" and live.text == ""
    plain = split_reply(assistant(2, "Just an answer."), thinking_s=None)
    view.set_messages([live, plain])
    assert not view.message_widget(1).reasoning_box.isHidden()
    assert view.message_widget(1).progress_box.isHidden()  # the toggle says it is thinking
    assert view.message_widget(2).reasoning_box.isHidden()


# -- citations -------------------------------------------------------------------------------

def test_clicking_a_citation_in_a_reply_shows_its_passage(view, qtbot):
    from app.ui.view_models import CitedPassage

    passages = (CitedPassage(1, "licence.txt, “Terms”", "You may copy the Program."),
                CitedPassage(2, "manual.pdf, page 3", "Press the red button twice."))
    view.set_messages([MessageItem(1, "assistant", "Press it twice [2]. Copying is allowed [1]. "
                                   "Not a source: [7].", passages=passages)])
    widget = view.message_widget(1)
    assert widget.item.text.endswith("[7].")  # Copy copies the reply as written
    body = widget.body
    found = body.document().find("[2]")
    assert found.charFormat().anchorHref() == "cite:2"
    assert body.document().find("[7]").charFormat().anchorHref() == ""
    found.setPosition(found.selectionStart() + 1)
    spot = body.cursorRect(found).center()
    qtbot.mouseClick(body.viewport(), Qt.LeftButton, pos=spot)
    assert widget.passage_box.isVisible()
    assert widget.passage_label.text() == "[2] manual.pdf, page 3\n\nPress the red button twice."
    assert "[1]</a> licence.txt" in widget.sources_label.text()
    qtbot.mouseClick(body.viewport(), Qt.LeftButton, pos=spot)  # the same again hides it
    assert not widget.passage_box.isVisible()


# -- long histories --------------------------------------------------------------------------

def test_a_long_chat_builds_its_newest_messages_first_and_older_ones_on_scrolling_up(view, qtbot):
    chat = long_chat(200)
    view.set_messages(chat)
    assert view.message_ids() == list(range(200))  # every message is known at once
    assert view.message_widget(199) is not None  # the newest are shown at once
    assert view.built_count() < 200 and view.message_widget(0) is None
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    assert view.built_count() < 200  # opening builds only around the end
    while view.message_widget(0) is None:  # the person scrolls up, again and again
        built = view.built_count()
        bar.setValue(0)
        qtbot.waitUntil(lambda: view.built_count() > built)
    assert view.message_widget(0).body.markdown() == chat[0].text
    assert view.built_count() == 200


def test_an_update_to_a_message_not_built_yet_is_shown_once_it_is(view, qtbot):
    view.set_messages(long_chat(60))
    assert view.message_widget(1) is None
    view.update_message(assistant(1, "Changed while out of view", version_index=1,
                                  version_count=2))
    view.apply_pending()
    assert view.message_ids() == list(range(60))  # updated in place, not appended
    bar = view.verticalScrollBar()
    while view.message_widget(1) is None:
        built = view.built_count()
        bar.setValue(0)
        qtbot.waitUntil(lambda: view.built_count() > built)
    assert view.message_widget(1).body.markdown() == "Changed while out of view"


def run_pending_layout_passes():
    """Run the layout passes already asked for (posted events), so positions read next are
    the ones the person will see, not the ones before the last change."""
    for _ in range(3):
        QtCore.QCoreApplication.sendPostedEvents()
        QtWidgets.QApplication.processEvents()


@pytest.mark.parametrize("reserve", ["as estimated", "too small", "too large"])
def test_building_older_messages_keeps_what_the_person_reads_in_place(view, qtbot, reserve):
    view.set_messages(long_chat(16))
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    qtbot.waitUntil(lambda: not view._build_timer.isActive())
    assert 16 - message_view.PAGE_BUILD <= view.built_count() < 16  # a page more builds all
    # The estimate of the messages not built yet is never exact: whether their reserve runs
    # out (what is built then moves the rest down) or is left over when the last is built
    # (what was built moves up), the message read stays where it is on screen.
    if reserve != "as estimated":
        maximum = bar.maximum()
        view._set_reserve(0 if reserve == "too small" else view._reserve.height() + 2000)
        qtbot.waitUntil(lambda: bar.maximum() != maximum and bar.value() == bar.maximum())
    widget = view.message_widget(view.message_ids()[16 - view.built_count()])
    bar.setValue(widget.mapTo(view.widget(), QtCore.QPoint(0, 0)).y() - 20)  # read the oldest
    on_screen = widget.mapTo(view.viewport(), QtCore.QPoint(0, 0)).y()
    qtbot.waitUntil(lambda: view.built_count() == 16)  # older messages are built above it
    qtbot.waitUntil(lambda: not view._build_timer.isActive())
    run_pending_layout_passes()
    assert widget.mapTo(view.viewport(), QtCore.QPoint(0, 0)).y() == on_screen
    assert not view._reserve.isVisible()


def test_messages_not_built_yet_have_room_reserved_so_building_moves_nothing_below(view, qtbot):
    view.set_messages(long_chat(200))
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    qtbot.waitUntil(lambda: not view._build_timer.isActive())
    page = view.widget()
    built = view.built_count()
    oldest = view.message_widget(200 - built)
    built_top = oldest.mapTo(page, QtCore.QPoint(0, 0)).y()
    assert built_top > 5 * (page.height() - built_top)  # the range spans the whole chat at once
    place, maximum = oldest.mapTo(page, QtCore.QPoint(0, 0)).y(), bar.maximum()
    bar.setValue(built_top - 10)  # up to the oldest built: older ones are built above it
    qtbot.waitUntil(lambda: view.built_count() >= built + 8)
    run_pending_layout_passes()
    assert oldest.mapTo(page, QtCore.QPoint(0, 0)).y() == place  # nothing below moved
    assert bar.maximum() == maximum


def test_scrolled_to_the_top_every_message_is_built_and_the_reserve_is_gone(view, qtbot):
    chat = long_chat(60)
    view.set_messages(chat)
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    bar.setValue(0)  # once: building carries on while the view reaches into the reserve
    qtbot.waitUntil(lambda: view.built_count() == 60, timeout=20000)
    qtbot.waitUntil(lambda: not view._build_timer.isActive())
    first = view.message_widget(0)
    top = view.widget().layout().contentsMargins().top()
    # The layout places the last message built on its next pass (a posted event): wait for
    # that pass, not for a time. With the reserve left behind it would never come to the top.
    qtbot.waitUntil(lambda: first.mapTo(view.widget(), QtCore.QPoint(0, 0)).y() == top)
    assert not view._reserve.isVisible()
    assert first.body.markdown() == chat[0].text


def test_jumping_into_the_messages_not_built_yet_says_they_are_loading(view, qtbot):
    view.set_messages(long_chat(60))
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    notice = view.findChild(QtWidgets.QLabel, "loadingEarlierMessages")
    assert not notice.isVisible()  # at the bottom the view shows built messages only
    bar.setValue(0)  # dragged to the top: the view shows the blank reserve
    assert notice.isVisible() and "Loading" in notice.text()
    assert notice.geometry().top() >= 0 and view.viewport().rect().contains(notice.geometry())
    qtbot.waitUntil(lambda: view.built_count() == 60, timeout=20000)
    qtbot.waitUntil(lambda: not notice.isVisible())  # the oldest messages are there now


def test_building_a_message_opens_no_window_for_its_parts(qtbot):
    shown_as_windows = []

    class Spy(QtCore.QObject):
        def eventFilter(self, watched, event):
            if event.type() == QtCore.QEvent.Type.Show and watched.isWidgetType() \
                    and watched.isWindow():
                shown_as_windows.append(watched.objectName())
            return False

    spy = Spy()
    QtWidgets.QApplication.instance().installEventFilter(spy)
    try:
        for role in ("user", "assistant"):
            widget = MessageWidget(MessageItem(1, role, "Some text\n\n```\ncode\n```"))
            qtbot.addWidget(widget)
    finally:
        QtWidgets.QApplication.instance().removeEventFilter(spy)
    assert shown_as_windows == []


@pytest.mark.parametrize("count", [3, 40])
def test_a_chat_opened_before_the_window_is_shown_leaves_no_blank_above_it(qtbot, count):
    # At start-up the last chat is opened while the window is still hidden: a widget's
    # isVisible() is False then, which once kept a short chat's reserve (and its "Loading
    # earlier messages" notice) standing above the messages built at once.
    widget = MessageView()
    qtbot.addWidget(widget)
    widget.resize(600, 400)
    widget.set_messages(long_chat(count))
    widget.show()
    qtbot.waitExposed(widget)
    bar = widget.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.value() == bar.maximum() and widget.built_count() >= min(count, 10))
    bar.setValue(0)
    qtbot.waitUntil(lambda: widget.built_count() == count, timeout=20000)
    qtbot.waitUntil(lambda: not widget._build_timer.isActive())
    first = widget.message_widget(0)
    top = widget.widget().layout().contentsMargins().top()
    qtbot.waitUntil(lambda: first.mapTo(widget.widget(), QtCore.QPoint(0, 0)).y() == top)
    assert widget._reserve.isHidden()
    assert widget.findChild(QtWidgets.QLabel, "loadingEarlierMessages").isHidden()
