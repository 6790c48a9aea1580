"""Guards on the Qt binding and the import boundaries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"


def test_qt_calls_do_not_leak_references_to_none():
    """PySide6 6.12.0 drops a reference to None per void call; on Python < 3.12 the process
    aborts ("deallocating None") after a few thousand calls. pyproject excludes it."""
    from app.ui.qt import QtCore

    obj = QtCore.QObject()
    before = sys.getrefcount(None)
    for _ in range(200):
        obj.setObjectName("x")
    assert abs(sys.getrefcount(None) - before) < 20


def test_only_app_ui_qt_imports_pyside6_and_the_gui_never_imports_torch():
    for path in APP.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(APP).as_posix()
        if rel != "ui/qt.py":
            assert "from PySide6" not in text and "import PySide6" not in text, rel
        if rel.startswith("ui/"):
            assert "import torch" not in text and "from torch" not in text, rel


def test_engine_models_storage_and_documents_load_without_qt():
    code = ("import sys, app.engine.engine, app.engine.session, app.storage, app.documents, "
            "app.server.api; assert not any(m.startswith('PySide6') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=APP.parent)
