"""The window as a newcomer meets it (issue 10): queued sends, Continue, titles, the Trash,
devices, honest figures and the small things (720 px, the pin, Esc, focus)."""

from __future__ import annotations

import re
import time

import pytest

from app.engine.events import Queued
from app.ui.chat_list import BADGE_ROLE
from app.ui.qt import QtCore, Qt
from app.ui.settings_dialogs import PreferencesDialog
from app.ui.titles import clean_title, fallback_title


pytestmark = pytest.mark.slow  # the real window on the real model


def _used_tokens(meter_text: str) -> int:
    match = re.match(r"([\d,]+) /", meter_text)
    return int(match.group(1).replace(",", "")) if match else 0


# -- 1. a message sent while the model loads waits for it ---------------------------------

def test_a_message_sent_while_the_model_loads_is_queued_then_sent(open_window):
    driver = open_window()
    assert driver.controller.model_info is None  # nothing has loaded: the event loop has not run
    assert not driver.window.load_bar.isHidden()  # the status bar shows the load going on
    driver.set_max_tokens(6)
    driver.type_and_send("Hello before the model")
    user, reply = driver.path()
    assert user.content == "Hello before the model" and reply.status == "streaming"
    assert driver.find("composer").toPlainText() == ""
    assert "queued" in driver.window.statusBar().currentMessage()
    driver.window.message_view.apply_pending()
    widget = driver.window.message_view.message_widget(reply.id)
    assert widget.progress_label.text().startswith("Queued")
    driver.wait_for_model()
    assert "sending your queued message" in driver.window.statusBar().currentMessage()
    assert driver.window.load_bar.isHidden()
    driver.wait_until_idle()
    assert driver.path()[-1].status == "complete" and driver.path()[-1].content


# -- 4. a reply cut by the token limit can be continued ---------------------------------

def test_a_cut_reply_says_so_and_continues_from_its_cached_kv(driver):
    driver.set_max_tokens(8)
    driver.type_and_send("Tell me a long story about a lighthouse keeper who lives alone on a "
                         "rocky island far out at sea, and what happens on the night of the "
                         "great storm when a ship comes too close to the rocks")
    driver.wait_until_idle()
    _, cut = driver.path()
    assert cut.metadata["finish_reason"] == "length"
    view = driver.window.message_view
    view.apply_pending()
    widget = view.message_widget(cut.id)
    assert not widget.continue_button.isHidden()
    assert "Cut off" in widget.info.text()
    driver.qtbot.mouseClick(widget.continue_button, Qt.LeftButton)
    driver.wait_until_idle()
    path = driver.path()
    assert len(path) == 2 and path[1].id == cut.id  # the same reply grew; no new turn
    longer = path[1]
    assert longer.content.startswith(cut.content) and len(longer.content) > len(cut.content)
    assert longer.metadata["completion_tokens"] > cut.metadata["completion_tokens"]
    # The continuation's prompt is the conversation plus the partial reply, and the cache
    # supplied it (page-aligned, so up to a page short of the whole).
    assert longer.metadata["prompt_tokens"] >= cut.metadata["prompt_tokens"] + 6
    assert longer.metadata["cached_tokens"] >= cut.metadata["prompt_tokens"] - 16 > 0


def test_a_stopped_reply_offers_continue_and_carries_on(driver):
    driver.set_max_tokens(200)
    driver.type_and_send("Tell me a long story about a lighthouse keeper.")
    reply = driver.controller.replies.for_chat(driver.controller.current_chat_id)
    driver.qtbot.waitUntil(lambda: len(reply.text) > 20, timeout=120_000)
    driver.controller.stop()
    driver.wait_until_idle()
    _, stopped = driver.path()
    assert stopped.status == "stopped" and stopped.content
    view = driver.window.message_view
    view.apply_pending()
    widget = view.message_widget(stopped.id)
    assert not widget.continue_button.isHidden()
    assert widget.info.text().startswith("Stopped")
    driver.set_max_tokens(6)
    driver.qtbot.mouseClick(widget.continue_button, Qt.LeftButton)
    driver.wait_until_idle()
    longer = driver.path()[1]
    assert longer.id == stopped.id and longer.status == "complete"
    assert longer.content.startswith(stopped.content) and len(longer.content) > len(stopped.content)


# -- 5. titles and the badge -------------------------------------------------------------

def test_fallback_titles_are_short_and_document_chats_take_the_document_name():
    assert fallback_title("Summarise this document.", ["report.pdf"]) == "report.pdf"
    assert fallback_title("", ["a.txt", "b.txt"]) == "a.txt and 1 more"
    assert fallback_title("Write a haiku about the sea at night please now", []) == \
        "Write a haiku about the sea…"
    assert fallback_title("First line\nsecond line", []) == "First line"
    assert clean_title('Title: "Haiku About the Sea."\nmore') == "Haiku About the Sea"
    assert clean_title("") is None and clean_title("word " * 20) is None
    # A fragment is not a title (a base model continuing the prompt wrote "(f)").
    assert clean_title("(f)") is None and clean_title("1.") is None and clean_title("A") is None
    assert clean_title("法国首都") == "法国首都" and clean_title("Go tips") == "Go tips"


def test_document_chat_title_and_the_badge_in_its_own_place(driver, tmp_path):
    controller = driver.controller
    document = tmp_path / "quarterly-report.txt"
    document.write_text("Revenue rose in every region this quarter.\n")
    controller.add_files([str(document)])
    chat = controller.current_chat_id
    driver.qtbot.waitUntil(lambda: bool(controller.pending.get(chat)
                                        and controller.pending[chat][0].tokens), timeout=30_000)
    driver.set_max_tokens(40)
    driver.type_and_send("Summarise this document.")
    title = driver.store.get_chat(chat).title
    assert title == "quarterly-report.txt"
    item = driver.window.chat_list.item_for(chat)
    driver.qtbot.waitUntil(lambda: item.data(BADGE_ROLE) == "writing…", timeout=60_000)
    assert item.text() == title  # the badge is not part of the title
    driver.wait_until_idle()
    assert driver.window.chat_list.item_for(chat).data(BADGE_ROLE) == ""


def test_a_chat_model_titles_the_chat_after_the_first_reply(driver, monkeypatch):
    from app.ui import builtin_models

    monkeypatch.setattr(builtin_models, "writes_titles", lambda path: True)  # Gemma: a base model
    controller = driver.controller
    asked = []
    real_submit = controller.bridge.submit
    controller.bridge.submit = lambda rid, messages, params, **kw: (
        asked.append((rid, messages)), real_submit(rid, messages, params, **kw))
    driver.set_max_tokens(12)
    driver.type_and_send("What is the capital of France and why is it famous")
    driver.wait_until_idle()
    title_requests = [messages for rid, messages in asked if rid.startswith("title")]
    assert len(title_requests) == 1 and "capital of France" in title_requests[0][-1].content
    driver.qtbot.waitUntil(lambda: not controller._title_jobs, timeout=60_000)
    title = driver.store.get_chat(controller.current_chat_id).title
    assert 1 <= len(title.split()) <= 8 and len(title) <= 60


# -- 6. devices --------------------------------------------------------------------------

def test_only_existing_devices_are_offered_and_a_failing_one_keeps_the_model(driver, qtbot):
    controller = driver.controller
    qtbot.waitUntil(lambda: len(controller.devices) > 1, timeout=10_000)  # the worker's answer
    assert "cuda" not in controller.devices  # the test machines have no CUDA
    dialog = PreferencesDialog(controller.engine_settings(), driver.window, devices=controller.devices)
    qtbot.addWidget(dialog)
    offered = [dialog.device.itemText(i) for i in range(dialog.device.count())]
    assert offered == list(controller.devices)
    dialog.close()
    before = controller.model_info
    engine_before = driver.store.get_setting("engine", {})
    controller.apply_preferences({"device": "cuda", "dtype": "auto", "prefill_chunk": 512,
                                  "context_size": 0})
    qtbot.waitUntil(lambda: bool(driver.alerts), timeout=30_000)
    assert "CUDA" in driver.alerts[-1][1] and "Still using" in driver.alerts[-1][1]
    assert controller.model_info is not None and controller.model_info.path == before.path
    assert driver.store.get_setting("engine", {}) == engine_before  # the setting is unchanged
    driver.set_max_tokens(3)
    driver.type_and_send("Still there?")
    driver.wait_until_idle()
    assert driver.path()[-1].status == "complete"


# -- 7. the Trash ------------------------------------------------------------------------

def test_deleted_chats_go_to_the_trash_and_can_be_restored_or_emptied(driver, qtbot):
    controller = driver.controller
    first = controller.current_chat_id
    controller.rename_chat(first, "Keep me")
    controller.new_chat()
    second = controller.current_chat_id
    controller.rename_chat(second, "Throw me away")
    controller.delete_chat(first)
    controller.delete_chat(second)
    controller._forget_undo()  # the 8-second Undo is long gone
    assert driver.window.chat_list.item_for(first) is None
    assert driver.find("trashButton").text() == "Trash (2)"
    dialog = controller.open_trash()
    try:
        assert dialog.chat_ids() == [second, first]
        dialog.select(first)
        qtbot.mouseClick(dialog.restore_button, Qt.LeftButton)
        assert driver.window.chat_list.item_for(first) is not None
        assert controller.current_chat_id == first
        assert dialog.chat_ids() == [second]
        qtbot.mouseClick(dialog.empty_button, Qt.LeftButton)
        assert dialog.chat_ids() == [] and driver.store.list_deleted_chats() == []
        assert driver.find("trashButton").text() == "Trash"
    finally:
        dialog.close()


# -- 8. figures that tell the truth ------------------------------------------------------

def test_prompt_reading_is_shown_from_the_first_event(driver):
    controller = driver.controller
    driver.set_max_tokens(4)
    driver.type_and_send("Hello")
    reply = controller.replies.for_chat(controller.current_chat_id)
    assert reply.progress_text() == "Preparing the prompt…"
    controller.wiring.on_event(Queued(reply.request_id, prompt_tokens=321))
    assert reply.progress_text().startswith("Reading the prompt… 0%")
    assert "321" in reply.progress_text()
    driver.wait_until_idle()


def test_context_meter_counts_the_reply_while_streaming_and_after_a_relaunch(open_window, tmp_path):
    data = tmp_path / "meter"
    driver = open_window(data)
    driver.wait_for_model()
    controller = driver.controller
    meter = driver.find("contextMeter")
    driver.set_max_tokens(40)
    driver.type_and_send("Tell me about the sea")
    reply = controller.replies.for_chat(controller.current_chat_id)
    driver.qtbot.waitUntil(lambda: reply.tokens >= 10 and reply.total > 0, timeout=60_000)
    driver.qtbot.waitUntil(lambda: _used_tokens(meter.text()) > reply.total, timeout=5_000)
    driver.wait_until_idle()
    after_reply = _used_tokens(meter.text())
    assert driver.window.speed_label.text().endswith("tok/s")
    controller.new_chat()  # a chat without a reply shows no speed of another chat
    assert driver.window.speed_label.text() == ""
    driver.window.close()
    again = open_window(data)
    again.wait_for_model()
    chat = again.store.list_chats()[-1]
    again.controller.show_chat(chat.id)
    again.qtbot.waitUntil(lambda: _used_tokens(again.find("contextMeter").text()) > 0,
                          timeout=10_000)
    # Counted as the next turn's prompt: the reply's end of turn and the next turn's opening
    # come on top of what the last reply used.
    assert 0 <= _used_tokens(again.find("contextMeter").text()) - after_reply <= 8


def test_a_message_too_long_for_the_context_fails_clearly_and_the_meter_shows_by_how_much(
        driver):
    context = driver.controller.model_info.context_length
    meter = driver.find("contextMeter")
    driver.type_and_send("sea " * (context + 200))
    driver.wait_until_idle()
    question, reply = driver.path()
    assert question.content.startswith("sea sea")  # the message is kept, to edit
    assert reply.status == "error" and "leaving no room for a reply" in reply.error
    # The meter counts the conversation again: over the context, against that context.
    driver.qtbot.waitUntil(lambda: _used_tokens(meter.text()) > context, timeout=30_000)
    assert meter.text().split(" / ")[1].startswith(f"{context:,} tokens")


def test_load_time_is_the_whole_wait_from_the_request(open_window, qtbot):
    driver = open_window(extra=["--model", "default"])  # the built-in model is prepared first
    opened = time.monotonic()
    prepared = []
    driver.controller.bridge.embeddedReady.connect(lambda _path: prepared.append(time.monotonic()))
    driver.wait_for_model()
    shown = float(re.search(r"loaded in ([\d.]+) s", driver.window.model_status.text()).group(1))
    # Preparing the file, then loading it: the figure covers both.
    assert shown + 0.05 >= (prepared[0] - opened) + driver.controller.model_info.load_seconds


# -- 10. small ones ----------------------------------------------------------------------

def test_at_the_minimum_width_nothing_in_the_top_bar_overlaps(driver, qtbot, tmp_path):
    window = driver.window
    window.resize(window.minimumWidth(), 480)
    window.show()
    qtbot.waitExposed(window)
    window.controller.rename_chat(window.controller.current_chat_id,
                                  "A rather long chat title that would not fit at all")
    qtbot.wait(50)
    widgets = [window.chat_title, window.model_picker, window.add_model_button,
               window.chat_settings_button]
    rects = [QtCore.QRect(w.mapTo(window, QtCore.QPoint(0, 0)), w.size()) for w in widgets]
    for i, a in enumerate(rects):
        for b in rects[i + 1:]:
            assert not a.intersects(b), (a, b)
    right = window.main_area.mapTo(window, QtCore.QPoint(window.main_area.width(), 0)).x()
    assert all(r.right() <= right for r in rects)
    assert window.model_picker.width() >= 120
    window.grab().save(str(tmp_path / "window-720.png"))


def test_pinned_chats_show_an_icon_not_an_emoji(driver):
    controller = driver.controller
    controller.pin_chat(controller.current_chat_id, True)
    item = driver.window.chat_list.item_for(controller.current_chat_id)
    assert "📌" not in item.text() and not item.icon().isNull()


def test_escape_clears_the_search_box(driver, qtbot):
    window = driver.window
    window.show()
    qtbot.waitExposed(window)
    search = driver.find("searchBox")
    window.focus_search()
    assert window.focusWidget() is search
    qtbot.keyClicks(search, "pears")
    qtbot.keyClick(search, Qt.Key.Key_Escape)
    assert search.text() == ""


def test_after_edit_and_send_the_focus_is_in_the_message_box(driver, qtbot):
    window = driver.window
    window.show()
    qtbot.waitExposed(window)
    driver.set_max_tokens(3)
    driver.type_and_send("First try")
    driver.wait_until_idle()
    user = driver.path()[0]
    window.message_view.apply_pending()
    widget = window.message_view.message_widget(user.id)
    widget.start_editing()
    widget.editor.setPlainText("Second try")
    qtbot.mouseClick(widget.save_edit_button, Qt.LeftButton)
    assert window.focusWidget() is window.composer.edit  # focused when the window is active
    driver.wait_until_idle()


def test_a_message_sent_while_another_model_loads_is_remembered_with_that_model(driver):
    # The model that answers a chat's first message is recorded as the chat's model. Sent
    # while a newly picked model loads, the message waits for that model; the one loaded
    # before was recorded, and the chat reopened on a model that had never answered it.
    controller, picker = driver.controller, driver.window.model_picker
    loaded = picker.currentData()
    other = next(picker.itemData(i) for i in range(picker.count())
                 if str(picker.itemData(i) or "").startswith("builtin:")
                 and picker.itemData(i) != loaded)
    picker.setCurrentIndex(picker.findData(other))
    picker.activated.emit(picker.currentIndex())
    assert controller.model_info is None  # loading
    controller.new_chat()
    chat_id = controller.current_chat_id
    driver.set_max_tokens(2)
    driver.type_and_send("Hello")
    driver.wait_for_model()
    driver.wait_until_idle()
    assert driver.path()[-1].content  # answered, by the model that loaded
    assert driver.store.get_chat(chat_id).model == other
