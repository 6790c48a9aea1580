"""Dialogs of the controller: chat settings, preferences, import and export.
A mixin of `ChatController`."""

from __future__ import annotations

from pathlib import Path

from app.storage import StorageError
from app.ui.defaults import SAMPLING_KEYS
from app.ui.qt import QtWidgets


class DialogActions:
    def _open_chat_settings(self) -> None:
        from app.ui.settings_dialogs import ChatSettingsDialog

        if self.current_chat_id is None:
            return
        chat = self.store.get_chat(self.current_chat_id)
        values = self._default_chat_settings()
        values["system_prompt"] = ""
        values.update(chat.settings or {})
        dialog = ChatSettingsDialog(values, self.window)
        if dialog.exec():
            self.store.update_chat_settings(chat.id, dialog.values())
            self._plan_indexing(chat.id)  # "search" indexes the documents waiting to be sent
            self._show_attachments()
            if dialog.make_default():  # remembered for the current model
                self.save_model_defaults({k: v for k, v in dialog.values().items()
                                          if k in SAMPLING_KEYS})

    def _open_preferences(self) -> None:
        from app.ui.settings_dialogs import PreferencesDialog

        dialog = PreferencesDialog(self.engine_settings(), self.window, devices=self.devices,
                                   dtypes=self.dtypes,
                                   disk_cache_default_mb=self.disk_cache_default_mb())
        if dialog.exec():
            self.apply_preferences(dialog.values())

    def _export_chat(self, kind: str, chat_id: int | None = None) -> None:
        from app.storage import export_file_name, export_json, export_markdown

        chat_id = chat_id or self.current_chat_id
        if chat_id is None:
            return
        chat = self.store.get_chat(chat_id)
        suffix = ".md" if kind == "md" else ".json"
        path, _ = QtWidgets.QFileDialog.getSaveFileName(
            self.window, "Export chat", str(Path.home() / export_file_name(chat.title, suffix)))
        if not path:
            return
        import json

        try:
            text = (export_markdown(self.store, chat_id) if kind == "md"
                    else json.dumps(export_json(self.store, chat_id), indent=2, ensure_ascii=False))
            Path(path).write_text(text, encoding="utf-8")
        except (OSError, StorageError) as exc:
            self._alert("Export failed", str(exc))
            return
        self.window.statusBar().showMessage(f"Exported to {path}", 6000)

    def _import_chat(self) -> None:
        """Read, check and add the chosen export on a pool thread (a large file takes
        seconds to parse); the chat opens when it is in."""
        from app.storage import import_chat_file
        from app.ui.background import run_in_background

        path, _ = QtWidgets.QFileDialog.getOpenFileName(self.window, "Import a chat",
                                                        str(Path.home()), "Chat JSON (*.json)")
        if not path:
            return
        self.window.statusBar().showMessage(f"Importing {Path(path).name}…")
        run_in_background(lambda: import_chat_file(self.store, path), self._on_chat_imported,
                          lambda exc: self._on_import_failed(path, exc))

    def _on_chat_imported(self, chat) -> None:
        self.window.statusBar().showMessage(f"Imported “{chat.title[:40]}”", 6000)
        self.current_chat_id = chat.id
        self.refresh_chat_list()
        self.show_chat(chat.id)

    def _on_import_failed(self, path: str, exc: Exception) -> None:
        self.window.statusBar().clearMessage()
        if not isinstance(exc, (OSError, ValueError, StorageError)):
            raise exc
        self._alert("Import failed", f"{Path(path).name}: {exc}")
