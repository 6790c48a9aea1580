"""Settings → Connections in the real window, against a real HTTP server on loopback that
answers like vLLM (tests/backends/sse_server.py): a wrong key is refused in words, a saved
connection's models join the picker, a reply streams in and is saved, and a 401 on a send
ends that reply with the error while the chat is kept."""

from __future__ import annotations

import pytest

from app.storage.connections import ConnectionStore, Keychain
from app.ui.qt import Qt
from app.ui.view_models import COMPLETE, ERROR, STOPPED
from tests.backends import transcripts as t
from tests.backends.sse_server import TranscriptServer, json_answer, sse_answer
from tests.storage.test_connections import MemoryKeyring, database_bytes

GOOD_KEY = "sk-loopback-good-7731"
TIMEOUT_MS = 30_000  # loopback answers in milliseconds; this only ends a hang


def needs_key(responder):
    """The route answers only with the right bearer key, as vLLM's --api-key does."""
    def respond(handler):
        if handler.headers.get("Authorization") != f"Bearer {GOOD_KEY}":
            json_answer(401, t.VLLM_401)(handler)
        else:
            responder(handler)
    return respond


def shown(view, message_id: int, text: str) -> bool:
    """The message's widget (built on the view's next update tick) shows `text`."""
    widget = view.message_widget(message_id)
    return widget is not None and (text in widget.body.toPlainText()
                                   or text in widget.error_label.text())


@pytest.mark.slow
@pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen: dialog show()/raise_()
def test_a_remote_model_answers_in_the_window(driver, qtbot):
    controller = driver.controller
    keyring = MemoryKeyring()
    controller.connections.close()
    controller.connections = ConnectionStore(driver.store.path, keychain=Keychain(keyring))
    with TranscriptServer() as server:
        server.route("GET", "/v1/models", needs_key(json_answer(200, t.VLLM_MODELS)))
        server.route("POST", "/v1/chat/completions", needs_key(sse_answer(t.vllm_stream())))

        driver.window.connections_action.trigger()
        dialog = controller.connections_dialog
        dialog.name.setText("My vLLM")
        dialog.base_url.setText(server.base_url)
        dialog.api_key.setText("sk-wrong")
        qtbot.mouseClick(dialog.test_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: not dialog.is_busy(), timeout=TIMEOUT_MS)
        assert "refused the API key (401): Unauthorized" in dialog.status.text()
        assert not controller.connections.list_connections()  # Test saves nothing

        dialog.api_key.setText(GOOD_KEY)
        qtbot.mouseClick(dialog.save_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: "model picker" in dialog.status.text(), timeout=TIMEOUT_MS)
        assert dialog.api_key.text() == ""
        assert list(keyring.entries.values()) == [GOOD_KEY]
        assert GOOD_KEY.encode() not in database_bytes(controller.connections)

        picker = driver.window.model_picker
        index = picker.findText(f"{t.VLLM_MODEL} — My vLLM (remote)")
        assert index > 0  # after the local models
        local = picker.itemData(0)
        picker.setCurrentIndex(index)
        picker.activated.emit(index)
        qtbot.waitUntil(lambda: controller.model_info is not None, timeout=TIMEOUT_MS)
        assert controller.model_info.context_length == 32768  # vLLM's max_model_len

        chat_id = controller.current_chat_id
        driver.type_and_send("Hello?")
        driver.wait_until_idle(timeout=TIMEOUT_MS)
        reply = driver.path()[-1]
        assert (reply.content, reply.status) == ("Hello there!", COMPLETE)
        assert reply.metadata["cached_tokens"] == 1184
        view = driver.window.message_view
        qtbot.waitUntil(lambda: shown(view, reply.id, "Hello there!"), timeout=TIMEOUT_MS)
        sent = server.posts()[0]  # (a title request may follow it)
        assert sent.headers["authorization"] == f"Bearer {GOOD_KEY}"
        assert sent.headers["x-session-id"] == str(chat_id)
        assert sent.json()["messages"][-1] == {"role": "user", "content": "Hello?"}

        # The server stops taking the key: the reply fails in words, the chat stays.
        server.route("POST", "/v1/chat/completions", json_answer(401, t.VLLM_401))
        driver.type_and_send("Again?")
        driver.wait_until_idle(timeout=TIMEOUT_MS)
        path = driver.path()
        assert path[-1].status == ERROR and "refused the API key (401)" in path[-1].error
        assert [m.content for m in path[:-1]] == ["Hello?", "Hello there!", "Again?"]
        qtbot.waitUntil(lambda: shown(view, path[-1].id, "refused the API key"), timeout=TIMEOUT_MS)

        # Rate-limited: the wait the server asks for is said; Retry (the reply's Regenerate
        # button) sends again once the server takes requests.
        server.route("POST", "/v1/chat/completions",
                     json_answer(429, t.RATE_LIMITED, headers={"Retry-After": "7"}))
        qtbot.mouseClick(driver.window.message_view.message_widget(path[-1].id).regenerate_button,
                         Qt.LeftButton)
        driver.wait_until_idle(timeout=TIMEOUT_MS)
        failed = driver.path()[-1]
        assert failed.status == ERROR and "(429)" in failed.error and "Try again in 7 s" in failed.error
        server.route("POST", "/v1/chat/completions", needs_key(sse_answer(t.vllm_stream())))
        qtbot.waitUntil(lambda: shown(view, failed.id, "Try again in 7 s"), timeout=TIMEOUT_MS)
        assert view.message_widget(failed.id).regenerate_button.text() == "Retry"
        qtbot.mouseClick(view.message_widget(failed.id).regenerate_button, Qt.LeftButton)
        driver.wait_until_idle(timeout=TIMEOUT_MS)
        retried = driver.path()[-1]
        assert (retried.content, retried.status) == ("Hello there!", COMPLETE)
        assert driver.store.versions(retried.id).count == 3  # the two failures stay as versions

        # A new key saved in the dialog is used at once by the loaded remote model.
        dialog.list.setCurrentRow(0)
        dialog.api_key.setText("sk-revoked")
        qtbot.mouseClick(dialog.save_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: controller.model_info is not None, timeout=TIMEOUT_MS)
        driver.type_and_send("Still there?")
        driver.wait_until_idle(timeout=TIMEOUT_MS)
        assert "refused the API key (401)" in driver.path()[-1].error
        assert server.posts()[-1].headers["authorization"] == "Bearer sk-revoked"

        # Stop closes a stalled stream at once; the text so far is saved.
        server.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream(), stall_after=2))
        driver.type_and_send("Slowly?")
        chat_id = controller.current_chat_id
        qtbot.waitUntil(lambda: controller.replies.for_chat(chat_id) is not None
                        and controller.replies.for_chat(chat_id).text == "Hello", timeout=TIMEOUT_MS)
        driver.window.stop_action.trigger()
        driver.wait_until_idle(timeout=TIMEOUT_MS)
        stopped = driver.path()[-1]
        assert (stopped.content, stopped.status) == ("Hello", STOPPED)

        # Continue on a remote model: a reply cut by the length limit is carried on by the
        # server (the partial reply sent as the final assistant message), in the same message.
        server.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream(finish="length")))
        driver.type_and_send("Long?")
        driver.wait_until_idle(timeout=TIMEOUT_MS)
        cut = driver.path()[-1]
        assert cut.metadata["finish_reason"] == "length"
        qtbot.waitUntil(lambda: view.message_widget(cut.id) is not None
                        and view.message_widget(cut.id).continue_button.isVisibleTo(view),
                        timeout=TIMEOUT_MS)
        server.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream()))
        qtbot.mouseClick(view.message_widget(cut.id).continue_button, Qt.LeftButton)
        driver.wait_until_idle(timeout=TIMEOUT_MS)
        continued = driver.store.get_message(cut.id)
        assert (continued.content, continued.status) == ("Hello there!Hello there!", COMPLETE)
        body = server.posts()[-1].json()
        assert body["messages"][-1] == {"role": "assistant", "content": "Hello there!"}
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False

        # The picker is per chat: this chat remembers its remote model; a new chat picks the
        # local one; switching chats switches the picker and the model that answers.
        remote_chat, remote = controller.current_chat_id, picker.currentData()
        assert driver.store.get_chat(remote_chat).model == remote
        controller.new_chat()
        local_chat = controller.current_chat_id
        picker.setCurrentIndex(picker.findData(local))
        picker.activated.emit(picker.currentIndex())
        driver.wait_for_model()
        assert controller.bridge.backend is None
        assert driver.store.get_chat(local_chat).model == local
        controller.show_chat(remote_chat)
        assert picker.currentData() == remote
        qtbot.waitUntil(lambda: controller.model_info is not None, timeout=TIMEOUT_MS)
        assert controller.model_info.dtype == "remote"
        controller.show_chat(local_chat)
        assert picker.currentData() == local
        driver.wait_for_model()
        assert controller.bridge.backend is None and controller.model_info.dtype != "remote"
        controller.show_chat(remote_chat)
        qtbot.waitUntil(lambda: controller.model_info is not None, timeout=TIMEOUT_MS)
        assert controller.model_info.dtype == "remote"

    # The remote chat switches to the local model mid-conversation: it loads and answers
    # the same conversation, and the chat now remembers the local model.
    picker.setCurrentIndex(picker.findData(local))
    picker.activated.emit(picker.currentIndex())
    driver.wait_for_model()
    assert controller.bridge.backend is None and controller.model_info.dtype != "remote"
    driver.set_max_tokens(4)
    driver.type_and_send("And locally?")
    driver.wait_until_idle()
    answered = driver.path()[-1]
    assert answered.status == COMPLETE and answered.metadata["backend"] == "local"
    assert driver.store.get_chat(remote_chat).model == local


@pytest.mark.qt_log_ignore("This plugin does not support")
def test_the_dialog_keeps_keys_out_of_the_database_and_names_each_failure(qtbot, monkeypatch):
    """No window, no model: the dialog alone on the real stores and a real loopback server."""
    import socket

    from app.storage import ChatStore
    from app.ui.connections_dialog import ConnectionsDialog
    from app.ui.remote_models import known_models

    with ChatStore() as settings, ConnectionStore(settings.path, keychain=Keychain(MemoryKeyring())) as store, \
            TranscriptServer() as server:
        server.route("GET", "/v1/models", needs_key(json_answer(200, t.VLLM_MODELS)))
        dialog = ConnectionsDialog(store, settings)
        qtbot.addWidget(dialog)
        changes = []
        dialog.changed.connect(lambda: changes.append(1))

        # Nothing listens on a port just closed: refused, said as such.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            closed_port = probe.getsockname()[1]
        dialog.name.setText("Down")
        dialog.base_url.setText(f"http://127.0.0.1:{closed_port}")
        qtbot.mouseClick(dialog.test_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: not dialog.is_busy(), timeout=TIMEOUT_MS)
        assert "connection refused" in dialog.status.text()

        dialog.base_url.setText("gpu-box:8000")  # no scheme: refused before any request
        qtbot.mouseClick(dialog.save_button, Qt.LeftButton)
        assert "must start with http://" in dialog.status.text() and not store.list_connections()

        # The key from an environment variable: nothing goes to the keychain.
        monkeypatch.setenv("FERROX_TEST_KEY", GOOD_KEY)
        dialog.name.setText("Env box")
        dialog.base_url.setText(server.base_url)
        dialog.use_env.setChecked(True)
        dialog.env_name.setText("FERROX_TEST_KEY")
        dialog.session_header.setText("X-Chat")
        dialog.context_sizes.setPlainText(f"{t.VLLM_MODEL} = 16384")
        qtbot.mouseClick(dialog.save_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: "model picker" in dialog.status.text(), timeout=TIMEOUT_MS)
        (saved,) = store.list_connections()
        assert saved.api_key_env == "FERROX_TEST_KEY" and not store.keychain._keyring().entries
        assert known_models(settings, saved.id) == [(t.VLLM_MODEL, 32768)]
        assert (saved.session_header, saved.context_sizes) == ("X-Chat", {t.VLLM_MODEL: 16384})
        assert dialog.context_sizes.toPlainText() == f"{t.VLLM_MODEL} = 16384"  # shown again
        assert GOOD_KEY.encode() not in database_bytes(store)

        dialog.list.setCurrentRow(0)
        qtbot.mouseClick(dialog.remove_button, Qt.LeftButton)
        assert not store.list_connections() and known_models(settings, saved.id) == []
        assert changes  # the picker was told each time
