"""Collecting a backend's events in a test, with a bounded wait for the reply's end."""

from __future__ import annotations

import threading

from app.engine.events import Event, Failed, Finished, Token

# Only ends a hang; a reply on loopback ends in milliseconds.
SAFETY_TIMEOUT_S = 60.0


class Collector:
    """An `on_event` listener that keeps every event and notes the end of the reply."""

    def __init__(self):
        self.events: list[Event] = []
        self.ended = threading.Event()
        self.first_token = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, event: Event) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.append(event)
        if isinstance(event, Token):
            self.first_token.set()
        if isinstance(event, (Finished, Failed)):
            self.ended.set()

    def wait(self) -> Event:
        assert self.ended.wait(SAFETY_TIMEOUT_S), "the reply never ended"
        terminal = [e for e in self.events if isinstance(e, (Finished, Failed))]
        assert len(terminal) == 1, terminal
        assert self.events[-1] is terminal[0]  # nothing after the end
        return terminal[0]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Token))
