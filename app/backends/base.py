"""The backend seam: what the chat layer needs from something that runs a model.

A `ChatBackend` loads a model, counts tokens, runs a chat and aborts it. It reports through
the engine's own event types (`app.engine.events`), so a reply from this computer's engine and
one from a vLLM server look the same to whoever listens:

    Queued? PrefillProgress* Token* then exactly one Finished or Failed

(a remote backend sends no Queued/PrefillProgress and Tokens without ids). Events arrive on a
backend thread, never the caller's; a listener hands them to its own thread (the GUI posts a
signal). `submit_chat` never raises for a failure of the run itself: a refused template, an
unreachable server, a cut stream each become one `Failed` with a sentence a person can read.

Adding a kind of backend: one module with a class that satisfies `ChatBackend` (and the
function that builds it from a saved connection), and one `BackendKind` line in
`app.backends.registry` (see there what a kind declares).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from app.engine.events import Event

if TYPE_CHECKING:  # importing sampling pulls in torch; the seam itself does not need it
    from app.engine.sampling import SamplingParams
    from app.models.chat_template import Message

Listener = Callable[[Event], None]


class BackendError(Exception):
    """A backend cannot do what was asked (load a model, list models); the message says why
    in words a person can act on."""


@dataclass(frozen=True)
class BackendModel:
    """A model a backend has ready. `context_length` is None when the backend cannot tell
    (the person sets it for that connection). `location` says where it runs, for the status
    bar: "this computer (cpu)", "gpu-box.lan:8000"."""

    kind: str  # the registry key: "local", "remote"
    name: str
    context_length: int | None
    location: str
    details: str = ""  # e.g. the local weight format and policy; free text


@runtime_checkable
class ChatBackend(Protocol):
    kind: str

    def describe(self) -> BackendModel | None:
        """The loaded model, or None before `load`."""

    def load(self, model_ref: str) -> BackendModel:
        """Make `model_ref` (a file path locally, a model name on a server) the one used.
        Blocking (loads weights or asks the server): call it off the GUI thread. Raises
        BackendError with a readable message."""

    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes. May be an estimate, and may ask a server: off the GUI thread."""

    def submit_chat(self, messages: Sequence[Message], params: SamplingParams, on_event: Listener,
                    request_id: str | None = None, session_id: str | None = None,
                    partial: str = "") -> str:
        """Start a reply to `messages` and return its request id at once; `on_event` gets the
        events from another thread. `session_id` names the conversation (a chat's stable id):
        the local engine files its cached pages under it, a remote one sends it as a header so
        a prefix-aware router keeps the chat on one worker. `partial` (Continue): the start of
        the assistant's reply, which the model carries on -- no end of turn, no new turn; the
        events then hold only the new text."""

    def abort(self, request_id: str) -> None:
        """Stop a reply: it ends with Finished(finish_reason="abort") and the text so far.
        Unknown or finished ids are ignored."""

    def close(self) -> None:
        """Stop everything in flight and let go of the model or connection."""
