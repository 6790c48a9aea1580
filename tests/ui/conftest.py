"""GUI fixtures: the real main window on the real embedded model, one data folder per test."""

from __future__ import annotations

import pytest

from app.main import create_main_window

MODEL_TIMEOUT_MS = 120_000
REPLY_TIMEOUT_MS = 180_000


class WindowDriver:
    """Drives the real window as a person would, and waits the way a test must."""

    def __init__(self, qtbot, window):
        self.qtbot, self.window = qtbot, window
        self.controller = window.controller
        self.store = self.controller.store
        self.alerts = []
        self.controller._alert = lambda title, text: self.alerts.append((title, text))
        self.controller._confirm = lambda title, text: True

    def wait_for_model(self):
        self.qtbot.waitUntil(lambda: bool(self.controller.model_info is not None
                                  or self.controller.model_error), timeout=MODEL_TIMEOUT_MS)
        assert self.controller.model_info is not None, self.controller.model_error

    def set_max_tokens(self, n: int, chat_id: int | None = None):
        self.store.update_chat_settings(chat_id or self.controller.current_chat_id,
                                        {"max_tokens": n, "temperature": 0})

    def type_and_send(self, text: str):
        composer = self.window.composer
        composer.set_text(text)
        self.qtbot.mouseClick(self.find("sendButton"), _left())

    def find(self, name: str):
        from app.ui.qt import QtWidgets

        widget = self.window.findChild(QtWidgets.QWidget, name)
        assert widget is not None, name
        return widget

    def wait_until_idle(self, chat_id: int | None = None, timeout: int = REPLY_TIMEOUT_MS):
        chat_id = chat_id or self.controller.current_chat_id
        self.qtbot.waitUntil(lambda: self.controller.replies.for_chat(chat_id) is None,
                             timeout=timeout)

    def path(self, chat_id: int | None = None):
        return self.store.active_path(chat_id or self.controller.current_chat_id)


def _left():
    from app.ui.qt import Qt

    return Qt.LeftButton


@pytest.fixture(scope="session")
def kernel_policy_cache(tmp_path_factory):
    """Where the first window's CPU kernel measurement is kept for the later windows of the
    session (each test has its own data folder; measuring again in each costs a minute on a
    busy 2-core machine; tests/engine tests the measurement itself)."""
    return tmp_path_factory.mktemp("kernel-policy") / "kernel_policy.json"


@pytest.fixture
def open_window(qtbot, embedded_model_path, tmp_path, kernel_policy_cache, shared_weight_cache):
    import shutil

    windows = []
    folders = []

    def open_(data_dir=None, extra=()):
        folder = data_dir or tmp_path / "data"
        folder.mkdir(parents=True, exist_ok=True)
        folders.append(folder)
        if kernel_policy_cache.exists() and not (folder / "kernel_policy.json").exists():
            shutil.copyfile(kernel_policy_cache, folder / "kernel_policy.json")
        args = ["--data-dir", str(folder), "--model", str(embedded_model_path), *extra]
        window = create_main_window(args)
        qtbot.addWidget(window)
        windows.append(window)
        return WindowDriver(qtbot, window)

    yield open_
    for window in windows:
        window.close()
    for folder in folders:
        if (folder / "kernel_policy.json").exists() and not kernel_policy_cache.exists():
            shutil.copyfile(folder / "kernel_policy.json", kernel_policy_cache)


@pytest.fixture
def driver(open_window):
    driver = open_window()
    driver.wait_for_model()
    return driver
