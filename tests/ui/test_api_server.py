"""The local API server from the window: turned on, it serves the window's model at the
address the status bar shows; turned off, the port closes; the choice is remembered; a busy
port is said, not hidden."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from app.ui.settings_dialogs import ApiServerDialog

TIMEOUT_MS = 60_000


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def test_the_window_serves_its_model_where_the_status_bar_says(driver, qtbot,
                                                                embedded_model_path):
    controller, port = driver.controller, _free_port()
    controller.apply_api_server(True, port)
    qtbot.waitUntil(lambda: controller.api_url != "", timeout=TIMEOUT_MS)
    label = driver.find("apiStatus")
    assert not label.isHidden() and label.text() == f"API :{port}"
    assert f"http://127.0.0.1:{port}/v1" in label.toolTip()
    assert controller.api_url == f"http://127.0.0.1:{port}/v1"
    models = httpx.get(f"{controller.api_url}/models", timeout=600).json()["data"]
    assert [m["id"] for m in models] == [Path(embedded_model_path).stem]
    reply = httpx.post(f"{controller.api_url}/completions", timeout=600,
                       json={"model": models[0]["id"], "prompt": "The sky is", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3

    controller.apply_api_server(False, port)
    qtbot.waitUntil(lambda: controller.api_url == "", timeout=TIMEOUT_MS)
    assert label.isHidden()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=600)
    assert controller.api_server_setting() == (False, port)


def test_a_busy_port_is_shown_and_the_saved_choice_starts_with_the_next_window(
        open_window, qtbot, tmp_path):
    folder = tmp_path / "data"
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    first = open_window(folder)
    first.controller.apply_api_server(True, port)
    label = first.find("apiStatus")
    qtbot.waitUntil(lambda: label.text() == "API server off", timeout=TIMEOUT_MS)
    assert f"Cannot listen on 127.0.0.1:{port}" in label.toolTip()
    assert first.controller.api_url == ""
    assert first.controller.api_server_setting() == (True, port)  # kept: the port may free up
    first.window.close()
    taken.close()

    second = open_window(folder)
    qtbot.waitUntil(lambda: second.controller.api_url != "", timeout=TIMEOUT_MS)
    assert second.controller.api_url == f"http://127.0.0.1:{port}/v1"
    second.wait_for_model()
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=600)
    assert health.json()["status"] == "ok"


def test_the_dialog_shows_the_address_it_will_serve_at(qtbot):
    dialog = ApiServerDialog(False, 8000)
    qtbot.addWidget(dialog)
    assert dialog.address.text() == "off" and not dialog.port.isEnabled()
    dialog.enabled.setChecked(True)
    dialog.port.setValue(9123)
    assert dialog.address.text() == "http://127.0.0.1:9123/v1"
    assert dialog.values() == (True, 9123)


def test_an_unreadable_saved_setting_reads_as_off(driver):
    driver.store.set_setting("api_server", {"enabled": "yes", "port": 80})
    assert driver.controller.api_server_setting() == (False, 8000)


@pytest.mark.qt_log_ignore("This plugin does not support")  # (the offscreen platform's dialog)
def test_clicking_the_address_opens_the_server_settings(driver, qtbot):
    from app.ui.qt import QtCore, QtWidgets

    controller = driver.controller
    controller.apply_api_server(True, _free_port())
    qtbot.waitUntil(lambda: controller.api_url != "", timeout=TIMEOUT_MS)
    seen = []

    def close_it():
        dialog = QtWidgets.QApplication.activeModalWidget()
        seen.append(type(dialog).__name__)
        dialog.reject()

    QtCore.QTimer.singleShot(100, close_it)
    driver.find("apiStatus").click()
    assert seen == ["ApiServerDialog"]
    assert controller.api_url != ""  # cancelled: still serving
