"""The GUI's entry points: `run_gui` for `python -m app` / `ferrox-chat`, and
`create_main_window` for tests (builds everything, shows nothing, runs no event loop)."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

_STARTED = time.perf_counter()

from app.paths import use_data_dir


def gui_parser() -> argparse.ArgumentParser:
    from app.cli import _Parser
    from app.engine.device import DEVICE_CHOICES

    parser = _Parser(prog="ferrox-chat", description="Ferrox Chat: chat with local language models.")
    parser.add_argument("--data-dir", default=None, help="where chats and models live "
                        "(default: the user data folder, or FERROX_DATA_DIR)")
    parser.add_argument("--model", default=None, help="a .gguf file to start with, or 'default'")
    parser.add_argument("--device", default=None, choices=DEVICE_CHOICES)
    parser.add_argument("--self-test", action="store_true",
                        help="send one message through the GUI, print the reply, exit")
    parser.add_argument("--exit-when-shown", action="store_true",
                        help="print the seconds until the main window is shown, then exit")
    return parser


def _application():
    from app.ui.qt import QtWidgets
    from app.ui.resources import app_icon

    app = QtWidgets.QApplication.instance()
    if app is None:
        app = QtWidgets.QApplication(sys.argv[:1])
        app.setApplicationName("Ferrox Chat")
        app.setOrganizationName("Ferrox")
        app.setDesktopFileName("ferrox-chat")  # Wayland app id = packaging/linux/ferrox-chat.desktop
        app.setWindowIcon(app_icon())
    return app


def create_main_window(argv: list[str] | None = None):
    """Build the main window, its store, worker and controller from GUI options.

    Creates the QApplication if there is none; does not show the window or start the event
    loop. The controller is reachable as `window.controller`."""
    from app.storage import ChatStore
    from app.ui.bridge import EngineBridge
    from app.ui.controller import ChatController
    from app.ui.main_window import MainWindow
    from app.ui.qt import QtWidgets

    args = gui_parser().parse_args(argv or [])
    _application()
    folder = use_data_dir(args.data_dir)
    store = ChatStore(folder)
    window = MainWindow()
    bridge = EngineBridge()
    QtWidgets.QApplication.instance().aboutToQuit.connect(bridge.shutdown)
    window.controller = ChatController(window, store, bridge, folder, model_override=args.model,
                                       device_override=args.device)
    # What is alive now (the imports, Qt's wrappers, the window) lives as long as the app:
    # out of the collector's sight, so a full collection set off by the model load's
    # allocations (on the worker, holding the GIL) no longer walks all of it (~100-150 ms
    # of GUI-thread stall at relaunch, scripts/bench_gui_stalls.py d).
    gc.freeze()
    window.controller.start()
    return window


def _open_window(argv: list[str]):
    """The main window; a damaged chat database is set aside (kept, renamed) and an empty
    one started when the person chooses to, rather than leaving them to find the file.
    StorageError for every other refusal, and when they choose to quit."""
    from app.storage import UnreadableDatabase, set_aside, set_aside_name
    from app.ui.qt import QtWidgets

    try:
        return create_main_window(argv)
    except UnreadableDatabase as exc:
        box = QtWidgets.QMessageBox(QtWidgets.QMessageBox.Icon.Critical,
                                    "Ferrox Chat cannot open its chats", str(exc))
        target = set_aside_name(exc.path)  # the name said is the name it gets
        box.setInformativeText(
            f"Or start with an empty chat history now? The damaged file is kept, renamed to "
            f"{target.name} in the same folder, for a later rescue.")
        fresh = box.addButton("Start with an empty history",
                              QtWidgets.QMessageBox.ButtonRole.AcceptRole)
        box.addButton("Quit", QtWidgets.QMessageBox.ButtonRole.RejectRole)
        box.exec()
        if box.clickedButton() is not fresh:
            raise
        kept = set_aside(exc.path, target)
        print(f"The damaged chat database was kept as {kept}", file=sys.stderr)
    return create_main_window(argv)


def run_gui(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = gui_parser().parse_args(argv)
    app = _application()
    from app.storage import StorageError
    from app.ui.qt import QtCore, QtWidgets

    folder = use_data_dir(args.data_dir)
    lock = QtCore.QLockFile(str(Path(folder) / "ferrox.lock"))
    if not lock.tryLock(100):
        QtWidgets.QMessageBox.information(None, "Ferrox Chat",
                                          f"Ferrox Chat is already running with the data folder {folder}.")
        print(f"error: Ferrox Chat is already running with {folder}", file=sys.stderr)
        return 1
    try:
        window = _open_window(argv)
    except StorageError as exc:
        QtWidgets.QMessageBox.critical(None, "Ferrox Chat cannot open its chats", str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.self_test:
        from app.ui.self_test import run_self_test

        return run_self_test(window, app)
    window.show()
    if args.exit_when_shown:
        def shown() -> None:
            print(f"window shown after {time.perf_counter() - _STARTED:.3f} s", flush=True)
            window.close()
            app.quit()

        QtCore.QTimer.singleShot(0, shown)
    return app.exec()
