"""Drive an `Engine` on its own thread and route each request's events to whoever asked.

The GUI's worker, the API server and the CLI all use this; none of them touch the engine's
state. Callbacks run on the engine thread: they must only hand the event on (a Qt signal, an
asyncio `call_soon_threadsafe`, a queue), never do slow work or touch widgets.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence

from app.engine.engine import Engine
from app.engine.events import Event, Failed, Finished
from app.engine.sampling import SamplingParams

Listener = Callable[[Event], None]


class EngineRunner:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._listeners: dict[str, Listener] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ferrox-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Listener,
               request_id: str | None = None, cache_owner: str | None = None) -> str:
        with self._lock:
            if self._stopping:  # nothing would ever answer: say so at once
                request_id = request_id or "closed"
                on_event(Failed(request_id, "The engine has been shut down."))
                return request_id
            request_id = self.engine.submit(prompt_ids, params, request_id, cache_owner)
            self._listeners[request_id] = on_event
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def clear_cache(self) -> None:
        self.engine.clear_cache()
        self._wake.set()

    def forget_cache_owner(self, owner: str) -> None:
        self.engine.forget_cache_owner(owner)
        self._wake.set()

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[Event]:
        """Blocking iterator over one request's events, ending with Finished or Failed.
        Leaving the loop early (break, exception, close) aborts the request."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        request_id = self.submit(prompt_ids, params, events.put)
        done = False
        try:
            while not done:
                event = events.get()
                done = isinstance(event, (Finished, Failed))
                yield event
        finally:
            if not done:
                self.abort(request_id)

    def close(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the thread."""
        with self._lock:
            self._stopping = True
            for request_id in list(self._listeners):
                self.engine.abort(request_id)
        # The loop processes the aborts (listeners hear their Finished events), then ends.
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()  # save the prefix cache to disk (when there is one)

    def _loop(self) -> None:
        while True:
            if not self.engine.has_work:
                if self._stopping:
                    return
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception:  # a bug must not kill the thread silently: fail what is open
                message = "The engine hit an internal error:\n" + traceback.format_exc(limit=3)
                with self._lock:
                    open_ids = list(self._listeners)
                events = [Failed(request_id, message) for request_id in open_ids]
                self.engine.reset()
            for event in events:
                self._dispatch(event)

    def _dispatch(self, event: Event) -> None:
        with self._lock:
            listener = self._listeners.get(event.request_id)
            if isinstance(event, (Finished, Failed)):
                self._listeners.pop(event.request_id, None)
        if listener is not None:
            try:
                listener(event)
            except Exception:  # a broken listener must not stop other chats
                traceback.print_exc()
