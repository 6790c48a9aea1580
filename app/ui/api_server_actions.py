"""The local API server from the window: Settings -> Local API server… turns it on or off
and picks its port (remembered; on again at the next start), the status bar shows its
port while it serves (a click on it opens the same settings). The server runs below the
GUI (app/server/embedded.py, started by the bridge's worker). A mixin of `ChatController`."""

from __future__ import annotations

from app.storage import StorageError
from app.ui.defaults import API_SERVER_DEFAULT, API_SERVER_KEY


class ApiServerActions:
    def api_server_setting(self) -> tuple[bool, int]:
        """(enabled, port) as saved; the default (off, DEFAULT_PORT) for anything unreadable."""
        saved = self.store.get_setting(API_SERVER_KEY, None)
        saved = saved if isinstance(saved, dict) else {}
        enabled = saved.get("enabled", API_SERVER_DEFAULT["enabled"])
        port = saved.get("port", API_SERVER_DEFAULT["port"])
        if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
            port = API_SERVER_DEFAULT["port"]
        return enabled is True, port

    def _start_saved_api_server(self) -> None:
        enabled, port = self.api_server_setting()
        if enabled:
            self.bridge.serve_api(port)

    def _open_api_server(self) -> None:
        from app.ui.settings_dialogs import ApiServerDialog

        dialog = ApiServerDialog(*self.api_server_setting(), parent=self.window)
        if dialog.exec():
            self.apply_api_server(*dialog.values())

    def apply_api_server(self, enabled: bool, port: int) -> None:
        """Save the choice and start, move or stop the server (answered by
        `_on_api_server_changed`)."""
        try:
            self.store.set_setting(API_SERVER_KEY, {"enabled": enabled, "port": port})
        except StorageError as exc:  # applied all the same; only not remembered
            self.window.statusBar().showMessage(f"The server setting was not saved: {exc}", 8000)
        self.bridge.serve_api(port if enabled else None)

    def _on_api_server_changed(self, url: str, error: str) -> None:
        label = self.window.api_status
        if error:
            label.setText("API server off")
            label.setToolTip(f"The local API server could not start: {error}\n"
                             "Click to pick another port.")
            label.show()
            self.window.statusBar().showMessage(f"The local API server could not start: {error}",
                                                15000)
        elif url:
            # Short: the status bar is crowded at small window widths (the tooltip has it all).
            label.setText(f"API :{url.rsplit(':', 1)[1].removesuffix('/v1')}")
            label.setToolTip(f"Other programs on this computer can use the loaded model at "
                             f"{url} (OpenAI-compatible). Click to change or stop it.")
            label.show()
        else:
            label.hide()
        self.api_url = url
