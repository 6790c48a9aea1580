"""A loaded model with its engine running: what the GUI's worker and the API server hold.

`ModelSession` owns the one `LoadedModel`, `Engine` and `EngineRunner`; switching models
stops the old runner (aborting what it was doing), drops the old weights, then loads the new
ones. Its methods take and return plain data (ids, strings, dataclasses), so a Qt worker can
call them without touching torch.

Loading never waits for the CPU kernel policy's measurement: a model loads in the cached
policy's format, or in the format another model measured fastest on this CPU
(`kernel_policy.borrowed_policy`), or in the safe default when this machine was never
measured, and a background tuner (`_PolicyTuner`) then measures (or validates the cached
choice) whenever the engine is idle. When the measured choice differs from what is loaded,
it prepares the model in the new format off the engine thread and hands it to the engine,
which swaps it in between requests (`Engine.replace_weights`). `policy_status` says what was
chosen and why. `watch` tells who follows the session (the API server inside the app) what
serves.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.engine.device import load_on, load_planned, plan_from_policy
from app.engine.engine import Engine, EngineConfig
from app.engine.kv_disk import open_store
from app.engine.runner import EngineRunner, Listener
from app.engine.sampling import SamplingParams
from app.models import decode_step
from app.models.chat_template import ContinuationTemplate, Message, encode_chat
from app.models.embedded import continues_text
from app.openmp import run_on_passing_thread


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
    decode_step: str = ""  # how decode passes run: "TorchScript", "Python", ... (decode_step.mode)


_CONTINUATION = ContinuationTemplate()


def _chat_template(loaded):
    """How the chat window writes a conversation for `loaded`: its own template, or as one
    text for a built-in base model (`embedded.continues_text`)."""
    return _CONTINUATION if continues_text(loaded.path) else loaded.template


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
        self._tuner: _PolicyTuner | None = None
        # Called (on the tuner's thread, with the new ModelInfo) once the background policy
        # measurement has settled what runs: the status bar's cue to show `policy_status`.
        self.on_policy: Callable[[ModelInfo], None] | None = None
        # Told what serves, on the loading thread, under the session's lock: (loaded,
        # runner) once a model is running, None just before it stops (the runner still
        # open). The API server inside the app follows the loaded model through it.
        self._watchers: list[Callable[[tuple | None], None]] = []
        self._lock = threading.Lock()

    @property
    def info(self) -> ModelInfo | None:
        loaded = self._loaded
        if loaded is None:
            return None
        context = self._runner.engine.context_length if self._runner else loaded.context_length
        return ModelInfo(str(loaded.path), loaded.name, loaded.architecture, str(loaded.device),
                         loaded.weights_label, context, loaded.load_seconds,
                         loaded.policy_label, loaded.policy_reason, decode_step.mode(loaded.model))

    @property
    def policy_status(self) -> str:
        """What the weight policy chose and why, for the status bar ("" without a model)."""
        loaded = self._loaded
        if loaded is None:
            return ""
        return f"{loaded.policy_label}: {loaded.policy_reason}" if loaded.policy_reason else loaded.weights_label

    def load(self, path: str | Path, device: str = "auto", dtype: str = "auto",
             engine_config: EngineConfig | None = None,
             progress: Callable[[str], None] | None = None, tune: bool = True) -> ModelInfo:
        """Blocking: run it off the GUI thread. Raises ModelError / DeviceError clearly.
        `progress` hears what the load is doing, as a sentence for the status bar (on this
        thread, or on the passing thread the load's torch work runs on: it must be
        thread-safe, as a Qt signal's emit is). `tune`: measure the CPU policy in the
        background afterwards (unless the environment sets FERROX_POLICY_TUNING=0, as the
        test suite does)."""
        say = progress or (lambda message: None)
        with self._lock:
            self._unload_locked()
            name = Path(path).name
            say(f"Loading {name}…")
            # Torch work on a thread that ends with it (app/openmp.py): the loading thread's
            # OpenMP helpers would otherwise halve the engine thread's decode speed.
            loaded = run_on_passing_thread(load_on, path, device, dtype, measure=False,
                                           progress=lambda f: say(f"Loading {name}… {f:.0%}"))
            self.engine_config = engine_config or self.engine_config
            self._loaded = loaded
            say(f"Starting {name}…")
            engine = run_on_passing_thread(Engine, loaded, self.engine_config,
                                           self._store_for(loaded))
            self._runner = EngineRunner(engine)
            self._tell_watchers((loaded, self._runner))
            plan = loaded.load_plan
            if (tune and plan is not None and plan.shapes is not None
                    and os.environ.get("FERROX_POLICY_TUNING", "1") != "0"):
                self._tuner = _PolicyTuner(loaded, self._runner.engine, self._store_for,
                                           lambda: self.on_policy and self.info and self.on_policy(self.info))
        return self.info

    def _store_for(self, loaded):
        if self.kv_dir is None:
            return None
        return open_store(self.kv_dir, loaded, self.engine_config.page_size, self.kv_budget_bytes)

    def wait_for_policy(self, timeout: float) -> bool:
        """Block until the background tuner is done (tests, bench); False on timeout."""
        tuner = self._tuner
        return tuner is None or tuner.wait(timeout)

    def unload(self) -> None:
        with self._lock:
            self._unload_locked()

    def watch(self, watcher: Callable[[tuple | None], None]) -> None:
        """Call `watcher` with what serves now, and again whenever that changes (see
        `_watchers`). It must not call back into the session's loading or unloading."""
        with self._lock:
            self._watchers.append(watcher)
            watcher((self._loaded, self._runner) if self._runner is not None else None)

    def unwatch(self, watcher: Callable[[tuple | None], None]) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def _tell_watchers(self, serving: tuple | None) -> None:
        for watcher in list(self._watchers):
            watcher(serving)

    def _unload_locked(self) -> None:
        if self._runner is not None:
            self._tell_watchers(None)
        if self._tuner is not None:
            self._tuner.stop()
            self._tuner = None
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
        return encode_chat(loaded.tokenizer, _chat_template(loaded), messages)

    def continuation_prompt(self, messages: Sequence[Message], partial_reply: str) -> list[int]:
        """The prompt that carries on `partial_reply`, the start of the assistant turn after
        `messages`: the chat prompt, then the partial text with no end of turn, so the model
        continues the same reply and the cache adopts the KV it already has for it."""
        loaded, _ = self._require()
        return (encode_chat(loaded.tokenizer, _chat_template(loaded), messages)
                + loaded.tokenizer.encode(partial_reply, special=True))

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Listener,
               request_id: str | None = None, cache_owner: str | None = None) -> str:
        _, runner = self._require()
        return runner.submit(prompt_ids, params, on_event, request_id, cache_owner)

    def forget_cache_owner(self, owner: str) -> None:
        """Delete the disk-cached pages only `owner` (a chat deleted for good) used."""
        if self._runner is not None:
            self._runner.forget_cache_owner(owner)

    def abort(self, request_id: str) -> None:
        if self._runner is not None:
            self._runner.abort(request_id)

    def clear_cache(self) -> None:
        if self._runner is not None:
            self._runner.clear_cache()

    def close(self) -> None:
        self.unload()



class _PolicyTuner:
    """Measures the CPU weight policy in the background while the engine is idle, and swaps
    in weights in the measured format when it differs from the loaded one.

    The measurement runs only after the engine has been idle for `IDLE_S`; it is abandoned
    the moment a request arrives (and tried again after the next idle stretch), so neither
    the person's requests nor the timings disturb each other. Gives up after `ATTEMPTS`."""

    IDLE_S = 1.0
    ATTEMPTS = 20

    def __init__(self, loaded, engine: Engine, store_for=None, settled=None):
        self.loaded, self.engine = loaded, engine
        self.store_for = store_for  # loaded model -> its KV disk store, or None
        self.settled = settled  # called once the measured format serves
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="policy-tuner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def _busy(self) -> bool:
        return self._stop.is_set() or self.engine.has_work

    def _wait_idle(self) -> bool:
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            if self.engine.has_work:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self.IDLE_S:
                return True
            self._stop.wait(0.1)
        return False

    def _run(self) -> None:
        from app.engine.kernel_policy import BORROWED, NOT_MEASURED, tune
        from app.paths import data_dir

        try:
            plan = self.loaded.load_plan
            for _ in range(self.ATTEMPTS):
                if not self._wait_idle():
                    return
                # (each attempt's torch work on a thread of its own: app/openmp.py)
                policy = run_on_passing_thread(tune, plan.shapes, data_dir(), self._busy)
                if policy is not None:
                    break
            else:
                return
            new_plan = plan_from_policy(policy, self.loaded.device, plan.file_bytes, plan.shapes)
            if policy.status == NOT_MEASURED and plan.policy_status == BORROWED:
                # This model's measurement was unusable (a busy machine): the format borrowed
                # from another model's measurement stays rather than dropping to the default.
                self.loaded.policy_reason = (f"{plan.reason}; its own measurement was unusable "
                                             f"({policy.reason}), so that stays")
            elif ((new_plan.dtype, new_plan.wide_dtype, new_plan.int4, new_plan.kv_dtype,
                   new_plan.per_head_from)
                    == (plan.dtype, plan.wide_dtype, plan.int4, plan.kv_dtype, plan.per_head_from)):
                self.loaded.policy_label, self.loaded.policy_reason = new_plan.label, new_plan.reason
            else:
                fresh = run_on_passing_thread(load_planned, self.loaded.path, self.loaded.device,
                                              new_plan)
                if self._stop.is_set():
                    return
                handled = self.engine.replacements_handled
                self.engine.replace_weights(fresh, self.store_for(fresh) if self.store_for else None)
                while self.engine.replacements_handled == handled and not self._stop.wait(0.05):
                    pass
            if self.settled is not None and not self._stop.is_set():
                self.settled()
        except Exception:  # the loaded default keeps serving; the next load measures again
            import traceback

            traceback.print_exc()
        finally:
            self._done.set()
