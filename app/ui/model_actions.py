"""The model half of the controller: the picker, loading, adding and removing models, and
the per-model defaults (context size, sampling). A mixin of `ChatController`, sharing its
state (`store`, `bridge`, `window`, `model_info`, `replies`, `_alert`, `_confirm`)."""

from __future__ import annotations

from pathlib import Path

from app.documents import format_for_prompt
from app.paths import models_dir
from app.storage import StorageError
from app.ui.defaults import EMBEDDED_KEY, ENGINE_DEFAULTS
from app.ui.qt import Qt, QtWidgets


class ModelActions:
    def engine_settings(self) -> dict:
        settings = dict(ENGINE_DEFAULTS)
        settings.update(self.store.get_setting("engine", {}) or {})
        context = self.model_defaults().get("context_size")
        if context is not None:  # remembered for this model
            settings["context_size"] = context
        if self.device_override:
            settings["device"] = self.device_override
        return settings

    # Per-model defaults (context size, sampling): the built-in model's live in the settings,
    # an added model's in its record.

    def _model_record(self):
        key = self.window.model_picker.currentData()
        return next((m for m in self.store.list_models() if m.path == key), None)

    def model_defaults(self) -> dict:
        record = self._model_record()
        if record is not None:
            return dict(record.defaults)
        return dict(self.store.get_setting("model_defaults:embedded", {}) or {})

    def save_model_defaults(self, changes: dict) -> None:
        record = self._model_record()
        if record is not None:
            self.store.update_model_defaults(record.id, changes)
        else:
            merged = self.model_defaults()
            merged.update(changes)
            self.store.set_setting("model_defaults:embedded", merged)

    def remove_current_model(self) -> None:
        """Forget the selected added model (its file stays) and go back to the built-in one."""
        record = self._model_record()
        if record is None:
            self._alert("Remove model", "The built-in model cannot be removed.")
            return
        if not self._confirm("Remove model", f"Remove {record.name} from the list? The file "
                             f"{record.path} stays where it is."):
            return
        self.store.remove_model(record.id)
        self.store.set_setting("model", EMBEDDED_KEY)
        self.model_override = None
        self.refresh_models()
        self.load_selected_model()

    def refresh_models(self) -> None:
        picker = self.window.model_picker
        picker.clear()
        picker.addItem("Gemma 3 270M (built in)", EMBEDDED_KEY)
        for record in self.store.list_models():
            picker.addItem(record.name, record.path)
            picker.setItemData(picker.count() - 1, record.path, Qt.ToolTipRole)
        wanted = self.model_override or self.store.get_setting("model", EMBEDDED_KEY)
        if wanted not in (EMBEDDED_KEY, "default") and picker.findData(wanted) < 0:
            picker.addItem(Path(wanted).name, wanted)
        index = picker.findData(EMBEDDED_KEY if wanted == "default" else wanted)
        picker.setCurrentIndex(max(index, 0))

    def load_selected_model(self) -> None:
        key = self.window.model_picker.currentData()
        self.model_info = None
        self._update_send_state()
        if key == EMBEDDED_KEY:
            self.window.model_status.setText("Preparing the built-in model…")
            self.bridge.prepare_embedded(str(models_dir(self.data_dir)))
        else:
            self._load_path(key)

    def _load_path(self, path: str) -> None:
        settings = self.engine_settings()
        self.bridge.load(path, settings["device"], settings["dtype"], int(settings["prefill_chunk"]),
                         int(settings.get("context_size") or 0))

    def _on_embedded_progress(self, done: int, total: int) -> None:
        self.window.model_status.setText(
            f"Preparing the built-in model… {100 * done // max(total, 1)}%")

    def _on_embedded_ready(self, path: str) -> None:
        self._load_path(path)

    def _on_model_loading(self, message: str) -> None:
        self.window.model_status.setText(message)

    def _on_model_loaded(self, info) -> None:
        self.model_info = info
        picker = self.window.model_picker
        if picker.currentData() != EMBEDDED_KEY:
            picker.setItemText(picker.currentIndex(), info.name)
        self.model_error = ""
        self.window.model_status.setText(f"{info.name} ready (loaded in {info.load_seconds:.1f} s)")
        self.window.device_label.setText(f"{info.device} · {info.dtype}")
        self._update_send_state()
        self._update_context_meter()
        for chip in self._pending_for(self.current_chat_id):  # count what waited for a model
            if chip.document is not None and chip.tokens is None:
                self.bridge.count_tokens(chip.key, format_for_prompt(chip.document))

    def _on_model_failed(self, message: str) -> None:
        self.model_info = None
        self.model_error = message
        self.window.model_status.setText("No model loaded")
        self._update_send_state()
        self._alert("The model could not be loaded", message)

    def _on_model_picked(self, _index: int) -> None:
        key = self.window.model_picker.currentData()
        if self.replies and not self._confirm(
                "Switch models?", f"{len(self.replies)} repl{'y is' if len(self.replies) == 1 else 'ies are'} "
                "still being written. Stop them and switch?"):
            self.refresh_models()
            return
        self.store.set_setting("model", key)
        self.model_override = None
        self.load_selected_model()

    def _choose_model_file(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self.window, "Add a model", str(Path.home()),
                                                        "GGUF models (*.gguf)")
        if path:
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
        self._alert("This model cannot be added",
                                      f"{Path(path).name}: {message}")

