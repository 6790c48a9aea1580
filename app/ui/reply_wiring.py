"""The one place the chat service meets Qt: backend events in, reply changes out.

A small QObject living on the GUI thread. The bridge's events (emitted on the engine's or a
remote stream's thread) reach it queued, go to `ChatService.apply`, and leave as signals the
widgets' side connects to (app/ui/controller.py). The save beat is here too: every
SAVE_INTERVAL_MS the service saves the replies whose text changed.

    changed(reply, event)  a reply moved on (queued, reading the prompt, a token)
    ended(reply)           a reply ended and was saved; `reply.outcome` says how
    unclaimed(event)       an event of no chat reply (a title request's)
    ticked()               after each save beat (live figures: speed, the context meter)
    saveFailed(message)
"""

from __future__ import annotations

from app.chat.service import ChatService
from app.ui.qt import QObject, QTimer, Signal
from app.ui.replies import SAVE_INTERVAL_MS


class ReplyWiring(QObject):
    changed = Signal(object, object)
    ended = Signal(object)
    unclaimed = Signal(object)
    ticked = Signal()
    saveFailed = Signal(str)

    def __init__(self, service: ChatService, bridge, parent: QObject | None = None):
        super().__init__(parent)
        self.service = service
        bridge.event.connect(self.on_event)
        bridge.submitFailed.connect(self.fail)
        self._timer = QTimer(self, interval=SAVE_INTERVAL_MS)
        self._timer.timeout.connect(self.save)
        self._timer.start()

    def on_event(self, event) -> None:
        reply = self.service.apply(event)
        if reply is None:
            self.unclaimed.emit(event)
        elif reply.outcome is not None:
            self.ended.emit(reply)
        else:
            self.changed.emit(reply, event)

    def fail(self, request_id: str, message: str) -> None:
        """End a reply here (the request never reached a model: refused, overflowing, its
        documents not found); its text so far is kept."""
        reply = self.service.replies.get(request_id)
        if reply is not None:
            self.service.fail(reply, message)
            self.ended.emit(reply)

    def save(self) -> None:
        for error in self.service.save_streams():
            self.saveFailed.emit(error)
        self.ticked.emit()

    def stop(self) -> None:
        """No more save beats (the app is closing)."""
        self._timer.stop()
