"""The model half of the controller: the picker, loading, adding and removing models, and
the per-model defaults (context size, sampling). A mixin of `ChatController`, sharing its
state (`store`, `bridge`, `window`, `model_info`, `replies`, `_alert`, `_confirm`).

A new choice (model or engine settings) is remembered only once it has loaded: one that
fails leaves the setting as it was, so the next launch does not open with the same error.

The picker is per chat: a chat remembers the model it is answered by (its `model`, a picker
key: a local path or built-in key, or a remote key), set when it first sends and whenever a
model is picked in it; showing a chat switches the picker (and the loaded model) to its
model. Local and remote mix freely mid-conversation: the prompt is the same plain messages.
The app-wide setting "model" is the choice for chats that have none yet.
"""

from __future__ import annotations

import time
from pathlib import Path

from app.documents import format_for_prompt
from app.paths import models_dir
from app.storage import StorageError
from app.ui.builtin_models import (LEGACY_KEYS, builtin_for_key, builtin_models, default_key,
                                   picker_key, picker_label)
from app.ui.defaults import DISK_CACHE_FOLDER, DISK_CACHE_KEY, EMBEDDED_KEY, ENGINE_DEFAULTS
from app.ui.qt import Qt, QTimer, QtWidgets
from app.ui.remote_models import known_context, picker_entries, route

LOAD_TICK_MS = 1000  # the status bar counts the seconds of a load


def is_model_folder(path: str) -> bool:
    """A Hugging Face model folder: config.json beside the weights."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


class ModelActions:
    def _init_model_state(self) -> None:
        self._load_started = 0.0  # when the person's action (or the start-up) asked for a model
        self._load_label = ""
        self._load_tick = QTimer(interval=LOAD_TICK_MS)
        self._load_tick.timeout.connect(self._show_load_progress)
        self._pending_engine: dict | None = None  # engine settings waiting to prove they load
        self._remember_model: str | None = None  # picker key to save as the choice once loaded
        self._loaded_key: str | None = None  # picker key of the model that last loaded
        self._local_key: str | None = None  # picker key of the local model last loaded
        self._remember_chat: tuple[int, str] | None = None  # (chat, picked key) once loaded
        self._starting = False

    def engine_settings(self) -> dict:
        settings = dict(ENGINE_DEFAULTS)
        settings.update(self.store.get_setting("engine", {}) or {})
        context = self.model_defaults().get("context_size")
        if context is not None:  # remembered for this model
            settings["context_size"] = context
        if self._pending_engine is not None:
            settings.update(self._pending_engine)
        if self.device_override:
            settings["device"] = self.device_override
        return settings

    # Per-model defaults (context size, sampling): a built-in model's live in the settings,
    # an added model's in its record.

    def _model_record(self):
        key = self.window.model_picker.currentData()
        return next((m for m in self.store.list_models() if m.path == key), None)

    def _defaults_key(self) -> str:
        key = self.window.model_picker.currentData() or EMBEDDED_KEY
        return f"model_defaults:{EMBEDDED_KEY if key == default_key() else key}"

    def model_defaults(self) -> dict:
        record = self._model_record()
        if record is not None:
            return dict(record.defaults)
        builtin = builtin_for_key(self.window.model_picker.currentData() or "")
        defaults = dict(builtin.sampling) if builtin is not None else {}
        defaults.update(self.store.get_setting(self._defaults_key(), {}) or {})
        return defaults

    def save_model_defaults(self, changes: dict) -> None:
        record = self._model_record()
        if record is not None:
            self.store.update_model_defaults(record.id, changes)
        else:
            merged = self.model_defaults()
            merged.update(changes)
            self.store.set_setting(self._defaults_key(), merged)

    def remove_current_model(self) -> None:
        """Forget the selected added model (its file stays) and go back to the built-in one."""
        record = self._model_record()
        if record is None:
            self._alert("Remove model", "A built-in model cannot be removed.")
            return
        if not self._confirm("Remove model", f"Remove {record.name} from the list? The file "
                             f"{record.path} stays where it is."):
            return
        self.store.remove_model(record.id)
        self.store.set_setting("model", default_key())
        self.model_override = None
        self.refresh_models()
        self.load_selected_model()

    def refresh_models(self) -> None:
        picker = self.window.model_picker
        picker.clear()
        for model in builtin_models():
            picker.addItem(picker_label(model), picker_key(model))
            picker.setItemData(picker.count() - 1, model.display_name, Qt.ToolTipRole)
        for record in self.store.list_models():
            picker.addItem(record.name, record.path)
            picker.setItemData(picker.count() - 1, record.path, Qt.ToolTipRole)
        for entry in self._remote_entries():  # after the local ones
            picker.addItem(entry.label, entry.key)
            picker.setItemData(picker.count() - 1, entry.tooltip, Qt.ToolTipRole)
        wanted = self.model_override or self.store.get_setting("model", default_key())
        builtin = builtin_for_key(wanted)
        chosen = route(wanted)
        if builtin is not None:
            wanted = picker_key(builtin)
        elif not chosen.needs_local_model and picker.findData(wanted) < 0:
            wanted = picker.itemData(0)  # its connection was removed: back to a local model
        elif wanted in LEGACY_KEYS or wanted.startswith("builtin:"):  # e.g. one no longer shipped
            wanted = picker.itemData(0)
        elif picker.findData(wanted) < 0:
            picker.addItem(Path(wanted).name, wanted)
        picker.setCurrentIndex(max(picker.findData(wanted), 0))

    def _remote_entries(self):
        try:
            return picker_entries(self.connections.list_connections(), self.store)
        except StorageError as exc:
            self.window.statusBar().showMessage(str(exc), 8000)
            return []

    def load_selected_model(self) -> None:
        """Load what the picker shows; the wait is timed from here (the person's action)."""
        key = self.window.model_picker.currentData()
        self.model_info = None
        self.model_error = ""
        self._update_send_state()
        self._load_started = time.monotonic()
        chosen = route(key)
        if not chosen.needs_local_model:  # a connection's model (remote, or another kind)
            self._start_load_progress(f"Connecting to {chosen.model}…")
            self._load_connection_model(chosen)
            return
        builtin = builtin_for_key(key) if key else None
        if builtin is not None:  # legacy keys ("embedded") map to the default built-in
            self._start_load_progress(f"Preparing {builtin.display_name}…")
            self.bridge.prepare_builtin(key, str(models_dir(self.data_dir)))
        else:
            self._start_load_progress(f"Loading {Path(key).name}…")
            self._load_path(key)

    def _load_connection_model(self, chosen) -> None:
        try:
            connection = self.connections.get_connection(chosen.connection_id)
        except StorageError:
            self._on_model_failed(f"The connection of {chosen.model} was removed; pick another model.")
            return
        self.bridge.load_backend(self.connections, chosen,
                                 known_context(connection, self.store, chosen.model))

    def _load_path(self, path: str) -> None:
        settings = self.engine_settings()
        self.bridge.load(path, settings["device"], settings["dtype"], int(settings["prefill_chunk"]),
                         int(settings.get("context_size") or 0), self.disk_cache())

    def disk_cache(self) -> tuple[str, int | None]:
        """(folder, budget bytes) of the conversations' KV cache on disk: 0 when the person
        turned it off, None (no setting) for the default budget."""
        megabytes = self.engine_settings().get(DISK_CACHE_KEY)
        budget = max(int(megabytes), 0) * 1_000_000 if megabytes is not None else None
        return str(Path(self.data_dir) / DISK_CACHE_FOLDER), budget

    def disk_cache_default_mb(self) -> int:
        return self.bridge.disk_cache_default_bytes(self.data_dir) // 1_000_000

    # -- progress in the status bar ----------------------------------------------------

    def _start_load_progress(self, label: str) -> None:
        bar = self.window.load_bar
        bar.setRange(0, 0)  # busy until a percentage is known
        bar.show()
        self._load_label = label
        self._load_tick.start()
        self._show_load_progress()

    def _show_load_progress(self) -> None:
        elapsed = time.monotonic() - self._load_started
        self.window.model_status.setText(f"{self._load_label} {elapsed:.0f} s")

    def _end_load_progress(self) -> None:
        self._load_tick.stop()
        self.window.load_bar.hide()

    def _on_embedded_progress(self, done: int, total: int) -> None:
        bar = self.window.load_bar
        bar.setRange(0, 100)
        bar.setValue(100 * done // max(total, 1))
        self._load_label = f"Preparing the built-in model… {100 * done // max(total, 1)}%"
        self._show_load_progress()

    def _on_embedded_ready(self, path: str) -> None:
        self.window.load_bar.setRange(0, 0)
        self._load_path(path)

    def _on_model_loading(self, message: str) -> None:
        self._load_label = message
        self._show_load_progress()

    # -- outcomes ----------------------------------------------------------------------

    def _on_model_loaded(self, info) -> None:
        self._end_load_progress()
        self.model_info = info
        picker = self.window.model_picker
        if picker.currentData() != self._loaded_key:
            # The chats' token counts were another model's (its tokenizer, its context):
            # each is counted again for this one when shown.
            self._last_usage.clear()
            self._restored.clear()
        self._loaded_key = picker.currentData()
        builtin = builtin_for_key(picker.currentData() or "")
        chosen = route(picker.currentData())
        local = chosen.needs_local_model
        if local:
            self._local_key = self._loaded_key
        self.chat.set_model(info.name, chosen.kind)  # saved with replies
        if builtin is None and local:
            picker.setItemText(picker.currentIndex(), info.name)
        self.model_error = ""
        waited = time.monotonic() - self._load_started  # the whole wait, preparing included
        name = builtin.display_name if builtin is not None else info.name
        self.window.model_status.setText(f"{name} ready (loaded in {waited:.1f} s)")
        self._show_format(info)
        self._commit_choices()
        self._update_send_state()
        self._update_context_meter()
        for chip in self._pending_for(self.current_chat_id):  # count what waited for a model
            if chip.document is not None and chip.tokens is None:
                self.bridge.count_tokens(chip.key, format_for_prompt(chip.document))
        if self.current_chat_id is not None and self.current_chat_id not in self._last_usage:
            self._count_chat(self.current_chat_id)
        self._submit_held()

    def _commit_choices(self) -> None:
        """The new model or settings loaded: now they are remembered."""
        if self._pending_engine is not None:
            pending, self._pending_engine = self._pending_engine, None
            self.save_model_defaults({"context_size": pending.pop("context_size", 0)})
            self.store.set_setting("engine", pending)
        if self._remember_model is not None:
            self.store.set_setting("model", self._remember_model)
            self._remember_model = None
        if self._remember_chat is not None:
            chat_id, key = self._remember_chat
            self._remember_chat = None
            self.remember_chat_model(chat_id, key)

    def _on_model_failed(self, message: str) -> None:
        self._end_load_progress()
        retry = self._pending_engine is not None or self._remember_model is not None
        self._pending_engine = self._remember_model = self._remember_chat = None
        self.model_info = None
        self.model_error = message
        self.window.model_status.setText("No model loaded")
        self._update_send_state()
        self._alert("The model could not be loaded", message + (
            "\n\nYour previous choice is kept and loaded again." if retry else ""))
        if retry:  # back to the model that loaded before
            picker = self.window.model_picker
            index = picker.findData(self._loaded_key) if self._loaded_key else -1
            if index < 0:
                self.refresh_models()
            else:
                picker.setCurrentIndex(index)
            self.load_selected_model()
        else:
            self._fail_held(message)

    def _show_format(self, info) -> None:
        """Where the model runs and in which format; what the CPU policy chose, and why, on
        hover."""
        self.window.device_label.setText(f"{info.device} · {info.dtype}")
        lines = [f"{info.policy_label}: {info.policy_reason}"] if info.policy_reason else []
        if info.decode_step:  # (a remote server's model has none)
            lines.append(f"Decode steps run in {info.decode_step}.")
        self.window.device_label.setToolTip("\n".join(lines))

    def _on_policy_settled(self, info) -> None:
        """The background measurement settled the loaded model's format (swapped in, or
        kept): show it, if that model is still the one in use."""
        if self.model_info is not None and self.model_info.path == info.path:
            self.model_info = info
            self._show_format(info)

    def _on_model_kept(self, info, message: str) -> None:
        """The new choice failed before the loaded model was let go: keep using it."""
        self._end_load_progress()
        self._pending_engine = self._remember_model = self._remember_chat = None
        self.model_info = info
        self.model_error = ""
        self.chat.set_model(info.name, "local")
        self._select_in_picker(info.path)
        self.window.model_status.setText(f"{info.name} ready (unchanged)")
        self._show_format(info)
        self._update_send_state()
        self._alert("The change could not be made",
                    f"{message}\n\nStill using {info.name} on {info.device}; the setting was "
                    "not changed.")
        self._submit_held()

    def _select_in_picker(self, path: str) -> None:
        picker = self.window.model_picker
        name = Path(path).name
        for index in range(picker.count()):
            builtin = builtin_for_key(picker.itemData(index) or "")
            if picker.itemData(index) == path or (builtin is not None and builtin.filename == name):
                picker.setCurrentIndex(index)
                return

    def _on_devices_found(self, devices, dtypes) -> None:
        self.devices, self.dtypes = tuple(devices), tuple(dtypes)

    def apply_preferences(self, values: dict) -> None:
        """Load the model with new engine settings (device, precision, chunk, context);
        they are saved once it has loaded, and dropped if it fails."""
        if self.replies and not self._confirm("Reload the model?", "Running replies will be stopped."):
            return
        self._pending_engine = dict(values)
        self.load_selected_model()

    def _on_model_picked(self, _index: int) -> None:
        key = self.window.model_picker.currentData()
        if self.replies and not self._confirm(
                "Switch models?", f"{len(self.replies)} repl{'y is' if len(self.replies) == 1 else 'ies are'} "
                "still being written. Stop them and switch?"):
            self.refresh_models()
            return
        self._remember_model = key
        self.model_override = None
        # This chat is answered by it from now on (remembered once it has loaded).
        self._remember_chat = (self.current_chat_id, key) if self.current_chat_id else None
        self.load_selected_model()

    # -- the picker per chat -------------------------------------------------------------

    def remember_chat_model(self, chat_id: int, key: str | None = None) -> None:
        """Record the chat's model: `key`, or (a chat's first send) the picker's, which is
        the one loaded or, while a load runs, the one loading: a message sent meanwhile
        waits for that model and is answered by it (the one loaded before was once
        recorded, and the chat reopened on a model that never answered it)."""
        try:
            chat = self.store.get_chat(chat_id)
            key = key or (None if chat.model else self.window.model_picker.currentData())
            if key and key != chat.model:
                self.store.set_chat_model(chat_id, key)
        except StorageError as exc:
            self.window.statusBar().showMessage(str(exc), 8000)

    def follow_chat_model(self, chat) -> None:
        """Showing `chat`: the picker switches to the chat's model and loads it. A chat
        without one, or whose model is gone from the picker, keeps what is loaded. A switch
        that would reload the local engine while replies run waits: the status bar says so
        (picking the model again switches once they end)."""
        wanted = chat.model
        picker = self.window.model_picker
        if not wanted or wanted == picker.currentData() or self.model_override:
            return
        index = picker.findData(wanted)
        if index < 0:
            return
        reloads_engine = route(wanted).needs_local_model and wanted != self._local_key
        if self.replies and reloads_engine and not self._starting:
            self.window.statusBar().showMessage(
                f"This chat was answered by {picker.itemText(index)}; it loads once the running "
                "replies end (or pick it now to stop them).", 10000)
            return
        picker.setCurrentIndex(index)
        if not self._starting:  # at start-up the first load follows
            self.load_selected_model()

    # -- adding models -------------------------------------------------------------------

    def _choose_model_file(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self.window, "Add a model file",
                                                        str(Path.home()), "GGUF models (*.gguf)")
        if path:
            self.bridge.inspect_model(path)

    def _choose_model_folder(self) -> None:
        path = QtWidgets.QFileDialog.getExistingDirectory(
            self.window, "Add a model folder (config.json, *.safetensors, tokenizer.json)",
            str(Path.home()))
        if path:
            self.add_model_paths([path])

    def add_model_paths(self, paths: list[str]) -> None:
        """Check each model file or folder in the worker; a refusal comes back as an alert."""
        for path in paths:
            if Path(path).is_dir() and not is_model_folder(path):
                self._alert("This folder is not a model",
                            f"{Path(path).name} has no config.json. A model folder holds "
                            "config.json, the *.safetensors weights and tokenizer.json.")
                continue
            self.bridge.inspect_model(path)

    def _on_model_inspected(self, path: str, facts) -> None:
        try:
            record = self.store.add_model(path, {
                "name": facts.name, "architecture": facts.architecture,
                "size_bytes": facts.size_bytes, "quantization": facts.quantization,
                "context_length": facts.context_length})
        except StorageError as exc:
            self._alert("Could not add the model", str(exc))
            return
        self.window.statusBar().showMessage(f"Added {facts.describe()}", 8000)
        self.refresh_models()
        index = self.window.model_picker.findData(record.path)
        if index >= 0:
            self.window.model_picker.setCurrentIndex(index)
            self._on_model_picked(index)

    def _on_model_rejected(self, path: str, message: str) -> None:
        self._alert("This model cannot be added", f"{Path(path).name}: {message}")
