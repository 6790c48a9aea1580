#!/usr/bin/env python3
"""Dev-only: the README's screenshots, taken from the real window with the default settings.

A fresh data folder, the default built-in model (SmolLM2 135M Instruct) and default sampling:
one chat asks "What is the capital of France?", a second "Write a haiku about the sea."; each
window is grabbed once its reply is complete.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/take_screenshots.py [--out docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

SHOTS = [("What is the capital of France?", "screenshot-chat.png"),
         ("Write a haiku about the sea.", "screenshot-haiku.png")]


def wait_until(app, condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        app.processEvents()
        time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    from app.main import create_main_window
    from app.ui.qt import QtWidgets

    data = tempfile.mkdtemp(prefix="ferrox-shots-")
    try:
        return _take(args, data, create_main_window, QtWidgets)
    finally:  # its weight cache alone is ~0.3 GB
        shutil.rmtree(data, ignore_errors=True)


def _take(args, data: str, create_main_window, QtWidgets) -> int:
    window = create_main_window(["--data-dir", data])
    app = QtWidgets.QApplication.instance()
    window.resize(1100, 720)
    window.show()
    controller = window.controller
    wait_until(app, lambda: controller.model_info is not None or controller.model_error, 300)
    if controller.model_error:
        raise SystemExit(controller.model_error)
    for i, (question, name) in enumerate(SHOTS):
        if i:
            controller.new_chat()
        chat_id = controller.current_chat_id
        controller.send(question)
        wait_until(app, lambda: controller.replies.for_chat(chat_id) is None, 300)
        time.sleep(1.0)  # the title request and the last repaint
        for _ in range(50):
            app.processEvents()
            time.sleep(0.02)
        path = Path(args.out) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not window.grab().save(str(path)):
            raise SystemExit(f"could not save {path}")
        print(question, "->", controller.store.active_path(chat_id)[-1].content.strip())
        print("saved", path)
    window.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
