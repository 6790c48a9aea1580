"""Starting the window (app/main.py): a damaged chat database is set aside -- kept, renamed --
and an empty history started when the person chooses to; otherwise nothing is touched."""

from __future__ import annotations

import pytest

from app.main import _open_window
from app.storage import DB_FILENAME, StorageError
from app.ui.qt import QtCore, QtWidgets

DAMAGED = b"SQLite format 3\x00" + b"\xff" * 4000


def _answer_with(label: str) -> None:
    """Click `label` in the start-up question once it is up (it is modal)."""
    def click() -> None:
        box = QtWidgets.QApplication.activeModalWidget()
        if box is None:
            QtCore.QTimer.singleShot(50, click)
            return
        next(b for b in box.buttons() if b.text() == label).click()
    QtCore.QTimer.singleShot(50, click)


def _args(folder, embedded_model_path):
    return ["--data-dir", str(folder), "--model", str(embedded_model_path)]


@pytest.mark.qt_log_ignore("This plugin does not support")  # the offscreen platform's dialog
def test_a_damaged_database_is_set_aside_when_asked(qtbot, tmp_path, embedded_model_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / DB_FILENAME).write_bytes(DAMAGED)
    _answer_with("Start with an empty history")
    window = _open_window(_args(folder, embedded_model_path))
    qtbot.addWidget(window)
    kept = list(folder.glob(f"{DB_FILENAME}.damaged-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == DAMAGED  # kept as it was, for a rescue
    assert window.controller.store.list_chats() is not None  # a fresh, working history
    window.close()


@pytest.mark.qt_log_ignore("This plugin does not support")
def test_quitting_leaves_a_damaged_database_where_it_is(qtbot, tmp_path, embedded_model_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / DB_FILENAME).write_bytes(DAMAGED)
    _answer_with("Quit")
    with pytest.raises(StorageError, match="damaged"):
        _open_window(_args(folder, embedded_model_path))
    assert (folder / DB_FILENAME).read_bytes() == DAMAGED
    assert not list(folder.glob("*.damaged-*"))
