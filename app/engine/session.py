"""A loaded model with its engine running: what the GUI's worker and the API server hold.

`ModelSession` owns the one `LoadedModel`, `Engine` and `EngineRunner`; switching models
stops the old runner (aborting what it was doing), drops the old weights, then loads the new
ones. Its methods take and return plain data (ids, strings, dataclasses), so a Qt worker can
call them without touching torch.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.engine.device import load_on
from app.engine.engine import Engine, EngineConfig
from app.engine.kv_disk import open_store
from app.engine.runner import EngineRunner, Listener
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message, encode_chat


@dataclass(frozen=True)
class ModelInfo:
    path: str
    name: str
    architecture: str
    device: str
    dtype: str
    context_length: int
    load_seconds: float
    # The CPU weight policy's choice and its reason, for the status bar (kernel_policy).
    policy_label: str = ""
    policy_reason: str = ""


class NoModelError(RuntimeError):
    """Asked to generate with no model loaded."""


class ModelSession:
    def __init__(self, engine_config: EngineConfig | None = None, kv_dir: Path | None = None,
                 kv_budget_bytes: int | None = None):
        self.engine_config = engine_config or EngineConfig()
        # Where the prefix cache is saved between runs (None: kept in memory only).
        self.kv_dir = Path(kv_dir) if kv_dir is not None else None
        self.kv_budget_bytes = kv_budget_bytes
        self._loaded = None
        self._runner: EngineRunner | None = None
        self._lock = threading.Lock()

    @property
    def info(self) -> ModelInfo | None:
        loaded = self._loaded
        if loaded is None:
            return None
        context = self._runner.engine.context_length if self._runner else loaded.context_length
        return ModelInfo(str(loaded.path), loaded.name, loaded.architecture, str(loaded.device),
                         loaded.weights_label, context, loaded.load_seconds,
                         loaded.policy_label, loaded.policy_reason)

    def load(self, path: str | Path, device: str = "auto", dtype: str = "auto",
             engine_config: EngineConfig | None = None) -> ModelInfo:
        """Blocking: run it off the GUI thread. Raises ModelError / DeviceError clearly."""
        with self._lock:
            self._unload_locked()
            loaded = load_on(path, device, dtype)
            self.engine_config = engine_config or self.engine_config
            self._loaded = loaded
            store = None
            if self.kv_dir is not None:
                store = open_store(self.kv_dir, loaded, self.engine_config.page_size, self.kv_budget_bytes)
            self._runner = EngineRunner(Engine(loaded, self.engine_config, store))
        return self.info

    def unload(self) -> None:
        with self._lock:
            self._unload_locked()

    def _unload_locked(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._loaded is not None:
            self._loaded.unload()
            self._loaded = None
            gc.collect()

    def _require(self):
        if self._loaded is None or self._runner is None:
            raise NoModelError("No model is loaded. Choose one in the model picker.")
        return self._loaded, self._runner

    def count_tokens(self, text: str) -> int:
        loaded, _ = self._require()
        return len(loaded.tokenizer.encode(text))

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        loaded, _ = self._require()
        return encode_chat(loaded.tokenizer, loaded.template, messages)

    def continuation_prompt(self, messages: Sequence[Message], partial_reply: str) -> list[int]:
        """The prompt that carries on `partial_reply`, the start of the assistant turn after
        `messages`: the chat prompt, then the partial text with no end of turn, so the model
        continues the same reply and the cache adopts the KV it already has for it."""
        loaded, _ = self._require()
        return (encode_chat(loaded.tokenizer, loaded.template, messages)
                + loaded.tokenizer.encode(partial_reply, special=True))

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Listener,
               request_id: str | None = None, cache_owner: str | None = None) -> str:
        _, runner = self._require()
        return runner.submit(prompt_ids, params, on_event, request_id, cache_owner)

    def forget_cache_owner(self, owner: str) -> None:
        """Delete the disk-cached pages only `owner` (a chat deleted for good) used."""
        if self._runner is not None:
            self._runner.engine.forget_cache_owner(owner)

    def abort(self, request_id: str) -> None:
        if self._runner is not None:
            self._runner.abort(request_id)

    def clear_cache(self) -> None:
        if self._runner is not None:
            self._runner.clear_cache()

    def close(self) -> None:
        self.unload()

