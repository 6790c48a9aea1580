"""A `ChatBackend` that plays a script instead of running a model: for tests of the layers
above the seam (chat service, window) that need replies, failures and aborts on demand
without loading a model or opening a socket.

    backend = ScriptedBackend(replies=[["Hel", "lo"], Failed-message-string, ...])

Each submit_chat takes the next entry: a list of text pieces (streamed as Tokens, then
Finished "stop"), or a string starting with "!" (a Failed with the rest as its message). A
list may end with `Cut("message")` (the pieces stream, then Failed: a stream cut mid-reply)
or `End("length")` (Finished with that reason instead of "stop").
Events are delivered on a thread of their own, as a real backend does; `hold()` makes the
next reply wait after its first piece until `abort` or `release()`.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from app.backends.base import BackendModel
from app.engine.events import Failed, Finished, Timings, Token, Usage


@dataclass(frozen=True)
class Cut:
    message: str


@dataclass(frozen=True)
class End:
    reason: str


class ScriptedBackend:
    kind = "scripted"

    def __init__(self, replies, *, context_length: int = 4096):
        self.replies = list(replies)
        self.context_length = context_length
        self.model: BackendModel | None = None
        self.sent: list[tuple[list, object, str | None]] = []  # (messages, params, session_id)
        self.partials: list[str] = []  # each submit's `partial` (Continue), "" for a new reply
        self._gate = threading.Event()
        self._gate.set()
        self._aborted: set[str] = set()
        self.threads: list[threading.Thread] = []

    def describe(self):
        return self.model

    def load(self, model_ref: str) -> BackendModel:
        self.model = BackendModel(self.kind, model_ref, self.context_length, "a script")
        return self.model

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def submit_chat(self, messages, params, on_event, request_id=None, session_id=None,
                    partial="") -> str:
        request_id = request_id or uuid.uuid4().hex
        self.sent.append((list(messages), params, session_id))
        self.partials.append(partial)
        entry = self.replies.pop(0)
        thread = threading.Thread(target=self._play, args=(request_id, entry, on_event), daemon=True)
        self.threads.append(thread)
        thread.start()
        return request_id

    def _play(self, request_id, entry, on_event) -> None:
        if isinstance(entry, str) and entry.startswith("!"):
            on_event(Failed(request_id, entry[1:]))
            return
        entry = list(entry)
        last = entry.pop() if entry and isinstance(entry[-1], (Cut, End)) else End("stop")
        text = ""
        for n, piece in enumerate(entry):
            if n == 1:
                self._gate.wait(30)
            if request_id in self._aborted:
                break
            text += piece
            on_event(Token(request_id, token_id=None, text=piece))
        if isinstance(last, Cut) and request_id not in self._aborted:
            on_event(Failed(request_id, last.message))
            return
        reason = "abort" if request_id in self._aborted else last.reason
        on_event(Finished(request_id, reason, text, Usage(10, 0, len(text.split())), Timings()))

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        self._gate.set()

    def close(self) -> None:
        for thread in self.threads:
            thread.join(30)
