"""This computer's engine behind the backend seam: `ModelSession` as a `ChatBackend`."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from app.backends.base import BackendError, BackendModel, Listener
from app.engine.events import Failed
from app.engine.session import ModelInfo, ModelSession, NoModelError


class LocalBackend:
    """Runs chats on the engine in this process. `session` may be shared with code that still
    talks to `ModelSession` directly (the bridge, during the move to the seam)."""

    kind = "local"

    def __init__(self, session: ModelSession | None = None, *, device: str = "auto",
                 dtype: str = "auto"):
        self.session = session or ModelSession()
        self.device = device
        self.dtype = dtype

    def describe(self) -> BackendModel | None:
        info = self.session.info
        return _model_of(info) if info is not None else None

    def load(self, model_ref: str | Path) -> BackendModel:
        from app.engine.device import DeviceError
        from app.models.errors import ModelError

        try:
            return _model_of(self.session.load(model_ref, self.device, self.dtype))
        except (ModelError, DeviceError) as exc:
            raise BackendError(str(exc)) from exc

    def count_tokens(self, text: str) -> int:
        try:
            return self.session.count_tokens(text)
        except NoModelError as exc:
            raise BackendError(str(exc)) from exc

    def submit_chat(self, messages: Sequence, params, on_event: Listener,
                    request_id: str | None = None, session_id: str | None = None,
                    partial: str = "") -> str:
        request_id = request_id or uuid.uuid4().hex
        try:
            prompt = (self.session.continuation_prompt(messages, partial) if partial
                      else self.session.chat_prompt(messages))
        except (NoModelError, ValueError) as exc:  # no model; a template refusing the roles
            failed = Failed(request_id, f"The conversation cannot be sent to this model: {exc}")
            # Off the caller's thread, like every other event (the seam's promise).
            threading.Thread(target=on_event, args=(failed,), daemon=True).start()
            return request_id
        return self.session.submit(prompt, params, on_event, request_id, cache_owner=session_id)

    def abort(self, request_id: str) -> None:
        self.session.abort(request_id)

    def close(self) -> None:
        self.session.close()


def _model_of(info: ModelInfo) -> BackendModel:
    details = info.dtype + (f", {info.policy_label}" if info.policy_label else "")
    return BackendModel("local", info.name, info.context_length, f"this computer ({info.device})",
                        details)
