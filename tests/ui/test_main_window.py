"""The real window on the real model: send, stream, stop, versions, documents, restart."""

from __future__ import annotations

import pytest

from app.ui.qt import QtWidgets
from app.ui.view_models import PREFILLING

OBJECT_NAMES = ["chatList", "newChatButton", "searchBox", "messageView", "composer", "sendButton",
                "stopButton", "attachButton", "attachmentList", "modelPicker", "contextMeter"]


def test_key_widgets_carry_their_object_names(driver):
    for name in OBJECT_NAMES:
        driver.find(name)


def test_send_and_receive_a_streamed_reply(driver):
    driver.set_max_tokens(12)
    driver.type_and_send("Hello there")
    reply = driver.controller.replies.for_chat(driver.controller.current_chat_id)
    assert reply is not None  # the GUI returned at once; the reply streams in the background
    driver.wait_until_idle()
    user, answer = driver.path()
    assert (user.role, user.content) == ("user", "Hello there")
    assert answer.role == "assistant" and answer.status == "complete" and answer.content
    assert answer.metadata["completion_tokens"] >= 1
    assert driver.find("composer").toPlainText() == ""
    assert driver.store.get_chat(driver.controller.current_chat_id).title == "Hello there"
    assert "tokens" in driver.find("contextMeter").text()


def test_the_status_bar_follows_the_measured_format_and_says_why(driver):
    """The background measurement settles the format after the window showed the one
    loaded first: the status bar shows the new one, its reason on hover; a settled format
    for a model no longer in use changes nothing."""
    import dataclasses

    label = driver.window.device_label
    loaded = driver.controller.model_info
    assert label.text() == f"{loaded.device} · {loaded.dtype}"
    elsewhere = dataclasses.replace(loaded, path="/elsewhere.gguf", dtype="float32")
    settled = dataclasses.replace(loaded, dtype="int4(bfloat16)+float16",
                                  policy_label="int4_bf16, bfloat16 KV",
                                  policy_reason="measured on this CPU: KV cache bfloat16")
    driver.controller.bridge.policySettled.emit(elsewhere)  # from the tuner's thread, queued
    driver.qtbot.wait(100)
    assert label.text() == f"{loaded.device} · {loaded.dtype}"
    driver.controller.bridge.policySettled.emit(settled)
    driver.qtbot.waitUntil(lambda: label.text() == f"{loaded.device} · int4(bfloat16)+float16",
                           timeout=5_000)
    assert label.toolTip().splitlines() == [
        "int4_bf16, bfloat16 KV: measured on this CPU: KV cache bfloat16",
        f"Decode steps run in {loaded.decode_step}."]
    # (not "Python (TorchScript unavailable)": the scripted step and the compiled layers run
    # here; which one depends on whether the run has the 8-bit kernel ready yet)
    assert loaded.decode_step in ("compiled layers", "TorchScript", "Python")
    assert driver.controller.model_info == settled


def test_send_is_refused_clearly_without_a_model(open_window, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a model")
    driver = open_window(extra=["--model", str(bad)])
    driver.qtbot.waitUntil(lambda: bool(driver.controller.model_error), timeout=60_000)
    assert driver.alerts and "broken.gguf" in driver.alerts[-1][1]
    driver.type_and_send("Anyone there?")
    assert driver.path() == []
    assert "No model" in driver.window.statusBar().currentMessage()


def test_two_chats_stream_at_once_while_switching(driver):
    controller = driver.controller
    first = controller.current_chat_id
    driver.set_max_tokens(40)
    driver.type_and_send("Tell me about rivers")
    controller.new_chat()
    second = controller.current_chat_id
    driver.set_max_tokens(40)
    driver.type_and_send("Tell me about mountains")
    both_running = len(controller.replies) == 2
    for _ in range(6):  # switch back and forth while both stream
        driver.window.chat_list.setCurrentRow((driver.window.chat_list.currentRow() + 1) % 2)
        driver.qtbot.wait(100)
    assert both_running
    driver.wait_until_idle(first)
    driver.wait_until_idle(second)
    for chat in (first, second):
        path = driver.path(chat)
        assert path[-1].status == "complete" and path[-1].content


def test_stop_mid_reply_keeps_what_was_written(driver):
    driver.set_max_tokens(400)
    # Greedy, so the reply is surely long (sampled, it once ended after a few tokens, before
    # the button could be pressed).
    driver.store.update_chat_settings(driver.controller.current_chat_id, {"temperature": 0.0})
    driver.type_and_send("Write a long story about a lighthouse keeper.")
    reply = driver.controller.replies.for_chat(driver.controller.current_chat_id)
    driver.qtbot.waitUntil(lambda: reply.tokens >= 5, timeout=60_000)
    assert driver.find("stopButton").isEnabled(), (reply.state, reply.outcome)
    driver.qtbot.mouseClick(driver.find("stopButton"), driver.window.controller and _left())
    driver.wait_until_idle()
    answer = driver.path()[-1]
    assert answer.status == "stopped"
    assert answer.metadata["completion_tokens"] < 400


def test_stop_mid_prefill_of_a_long_document(driver, tmp_path):
    document = tmp_path / "notes.txt"
    document.write_text("The quarterly report lists figures for each region. " * 500)
    driver.controller.add_files([str(document)])
    driver.qtbot.waitUntil(lambda: bool(driver.controller.pending.get(driver.controller.current_chat_id)
                           and driver.controller.pending[driver.controller.current_chat_id][0].tokens),
                           timeout=30_000)
    driver.set_max_tokens(8)
    driver.type_and_send("Summarise")
    reply = driver.controller.replies.for_chat(driver.controller.current_chat_id)
    driver.qtbot.waitUntil(lambda: reply.state == PREFILLING and reply.done > 0, timeout=60_000)
    assert "Reading the prompt" in reply.progress_text()
    driver.window.controller.stop()
    driver.wait_until_idle()
    answer = driver.path()[-1]
    assert answer.status == "stopped" and answer.content == ""
    widget = driver.window.message_view.message_widget(answer.id)
    assert widget.continue_button.isHidden()  # nothing written yet: nothing to carry on from


def test_regenerate_and_edit_keep_every_version(driver):
    controller = driver.controller
    driver.set_max_tokens(6)
    driver.store.update_chat_settings(controller.current_chat_id, {"temperature": 1.0})
    question = ("Name a colour that you like, and say in a few words why it would be a good "
                "colour for the kitchen wall of a small flat")  # longer than two 16-token pages
    driver.type_and_send(question)
    driver.wait_until_idle()
    first_reply = driver.path()[-1]
    controller.regenerate(first_reply.id)
    driver.wait_until_idle()
    versions = driver.store.versions(driver.path()[-1].id)
    assert versions.count == 2 and versions.index == 1
    # The same prompt again: the engine reused the KV it already had for it.
    assert driver.path()[-1].metadata["cached_tokens"] > 0
    controller.switch_version(driver.path()[-1].id, -1)
    assert driver.path()[-1].id == first_reply.id
    user = driver.path()[0]
    controller.edit_and_resend(user.id, "Name an animal")
    driver.wait_until_idle()
    path = driver.path()
    assert path[0].content == "Name an animal"
    assert driver.store.versions(path[0].id).count == 2
    controller.switch_version(path[0].id, -1)
    assert [m.content for m in driver.path()][0] == question
    assert driver.store.versions(driver.path()[-1].id).count == 2  # both replies still there


def test_documents_are_read_and_used_and_binaries_refused(driver, tmp_path):
    from tests.documents.test_extract import make_pdf  # the documents tests' PDF builder

    text = tmp_path / "fruit.txt"
    text.write_text("The secret fruit is a mango.\n")
    pdf = tmp_path / "report.pdf"
    pdf.write_bytes(make_pdf(["The secret city is Lisbon."]))
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    controller = driver.controller
    controller.add_files([str(text), str(pdf), str(binary)])
    chat = controller.current_chat_id
    driver.qtbot.waitUntil(lambda: len(controller.pending.get(chat, [])) == 2
                           and all(p.tokens for p in controller.pending[chat]), timeout=30_000)
    driver.qtbot.waitUntil(lambda: bool(driver.alerts), timeout=10_000)
    assert "image.png" in driver.alerts[-1][1]
    driver.set_max_tokens(8)
    driver.type_and_send("What are the secrets?")
    driver.wait_until_idle()
    user, answer = driver.path()
    assert [a.name for a in user.attachments] == ["fruit.txt", "report.pdf"]
    assert "Lisbon" in user.attachments[1].text
    doc_tokens = sum(a.token_count for a in user.attachments)
    assert answer.metadata["prompt_tokens"] > doc_tokens > 10


def test_restart_shows_everything(open_window, embedded_model_path, tmp_path):
    data = tmp_path / "shared-data"
    driver = open_window(data)
    driver.wait_for_model()
    driver.set_max_tokens(6)
    driver.type_and_send("Remember this")
    driver.wait_until_idle()
    before = [(m.role, m.content) for m in driver.path()]
    driver.window.close()
    again = open_window(data)
    chats = again.store.list_chats()
    assert [c.title for c in chats] == ["Remember this"]
    assert [(m.role, m.content) for m in again.path(chats[0].id)] == before


def _left():
    from app.ui.qt import Qt

    return Qt.LeftButton


@pytest.mark.parametrize("name", ["searchBox"])
def test_search_filters_chats_by_text(driver, name):
    controller = driver.controller
    driver.set_max_tokens(4)
    driver.type_and_send("Apples and pears")
    driver.wait_until_idle()
    controller.new_chat()
    controller.rename_chat(controller.current_chat_id, "Something else")
    search = driver.find(name)
    search.setText("pears")
    driver.qtbot.waitUntil(lambda: driver.window.chat_list.count() == 1, timeout=5_000)
    assert "Apples" in driver.window.chat_list.item(0).text()
    assert isinstance(search, QtWidgets.QLineEdit)


def test_a_document_larger_than_the_context_is_shortened_only_when_chosen(open_window, tmp_path):
    from app.storage import ChatStore

    data = tmp_path / "data"
    data.mkdir()
    with ChatStore(data) as store:  # a 2,048-token context keeps this quick on 2 cores
        store.set_setting("engine", {"context_size": 2048})
    driver = open_window(data)
    driver.wait_for_model()
    controller = driver.controller
    assert controller.model_info.context_length == 2048
    big = tmp_path / "book.txt"
    big.write_text("Chapter one begins on a quiet morning by the harbour. " * 300)  # ~3.3k tokens
    chat = controller.current_chat_id
    driver.store.update_chat_settings(chat, {"documents": "whole"})  # not searched (issue 14)
    controller.add_files([str(big)])
    driver.qtbot.waitUntil(lambda: bool(controller.pending.get(chat)
                                        and controller.pending[chat][0].tokens), timeout=60_000)
    chip = driver.window.composer.attachment_chips()[0]
    assert "over the context" in chip.chip.warning
    asked = []
    controller._confirm = lambda title, text: asked.append(text) or False  # the person declines
    driver.set_max_tokens(4)
    driver.type_and_send("What happens?")
    driver.wait_until_idle()
    assert "over" in asked[0] and driver.path()[-1].status == "error"
    assert len(driver.path()) == 2  # nothing was cut or resent
    controller._confirm = lambda title, text: True  # now they choose to shorten
    controller.regenerate(driver.path()[-1].id)
    driver.wait_until_idle(timeout=600_000)
    user, reply = driver.path()
    assert driver.store.versions(user.id).count == 2  # the original stays as a version
    assert "cut to fit" in user.attachments[0].text
    assert reply.status == "complete"


def test_a_document_dropped_while_the_model_loads_gets_its_token_count(open_window, tmp_path):
    note = tmp_path / "note.md"
    note.write_text("# Shopping\n\n- apples\n- bread\n")
    driver = open_window(extra=["--model", "default"])  # assembles the model first: slower
    controller = driver.controller
    controller.add_files([str(note)])
    chat = controller.current_chat_id
    driver.qtbot.waitUntil(lambda: bool(controller.pending.get(chat))
                           and controller.pending[chat][0].tokens is not None, timeout=120_000)
    assert controller.pending[chat][0].tokens > 5
    driver.wait_for_model()
