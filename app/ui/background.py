"""One short job off the GUI thread: `run_in_background(work, on_done, on_failed)` runs
`work()` on Qt's thread pool and calls `on_done(result)` or `on_failed(exception)` back on
the GUI thread. For work that needs no state of its own between calls (importing a file);
the engine and the document index have their own worker threads."""

from __future__ import annotations

from collections.abc import Callable

from app.ui.qt import QObject, QtCore, Signal, Slot


class _Relay(QObject):
    """Lives on the GUI thread: a signal emitted on the pool's thread reaches its slot
    queued, so the callbacks run on the GUI thread."""

    finished = Signal(bool, object)  # ok, result or exception

    def __init__(self, on_done: Callable, on_failed: Callable):
        super().__init__()
        self._on_done, self._on_failed = on_done, on_failed
        self.finished.connect(self._deliver)

    @Slot(bool, object)
    def _deliver(self, ok: bool, value) -> None:
        _running.discard(self)
        (self._on_done if ok else self._on_failed)(value)


class _Job(QtCore.QRunnable):
    def __init__(self, work: Callable, relay: _Relay):
        super().__init__()
        self._work, self._relay = work, relay

    def run(self) -> None:
        try:
            result = self._work()
        except Exception as exc:  # handed to on_failed: the caller says which ones it expects
            self._relay.finished.emit(False, exc)
        else:
            self._relay.finished.emit(True, result)


_running: set[_Relay] = set()  # keeps each relay alive until its job reports


def run_in_background(work: Callable[[], object], on_done: Callable[[object], None],
                      on_failed: Callable[[Exception], None]) -> None:
    relay = _Relay(on_done, on_failed)
    _running.add(relay)
    QtCore.QThreadPool.globalInstance().start(_Job(work, relay))
