"""Settings → Connections…: remote OpenAI-compatible servers (vLLM, SGLang, llama.cpp
server, Ollama) to list, add, edit, remove and test.

The API key goes to the OS keychain through `ConnectionStore` (or the connection names an
environment variable holding it); this dialog never writes it anywhere else, and clears the
field once saved. Listing a server's models (Test, and after Save) runs on Qt's thread pool
(`run_in_background`), so a slow or silent server never blocks the window; each failure the
backend reports (refused, DNS, TLS, 401, 404, timeout, ...) is shown as its own sentence.
A list fetched for a saved connection is remembered, and `changed` tells the window to
refresh the model picker.
"""

from __future__ import annotations

import os

from app.backends.base import BackendError
from app.backends.base_url import BaseUrlError
from app.backends.remote import RemoteSettings
from app.storage.connections import DEFAULT_SESSION_HEADER
from app.storage.errors import StorageError
from app.ui.background import run_in_background
from app.ui.qt import Qt, QtWidgets, Signal
from app.ui.remote_models import fetch_models, forget_models, remember_models

NEW = None  # the form edits a connection not saved yet
SHOWN_MODELS = 8


def parse_context_sizes(text: str) -> dict[str, int]:
    """"model = tokens" lines (blank lines skipped) into a dict; StorageError says which line
    is wrong. The store checks the ranges."""
    sizes: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        model, sep, tokens = line.rpartition("=")
        try:
            if not sep or not model.strip():
                raise ValueError
            sizes[model.strip()] = int(tokens.strip().replace(",", "").replace("_", ""))
        except ValueError:
            raise StorageError(f"Context sizes, line {number}: write it as “model = tokens”, "
                               f"for example “llama3.3:70b = 32768”, not {line.strip()!r}.") from None
    return sizes


def format_context_sizes(sizes: dict[str, int]) -> str:
    return "\n".join(f"{model} = {tokens}" for model, tokens in sizes.items())


class ConnectionsDialog(QtWidgets.QDialog):
    changed = Signal()  # connections or their model lists changed: refresh the picker
    saved = Signal(int)  # this connection's settings or key were saved: rebuild its backend

    def __init__(self, connections, settings, parent=None):
        """`connections`: a ConnectionStore; `settings`: the ChatStore (remembered lists)."""
        super().__init__(parent)
        self.connections, self.settings = connections, settings
        self.setWindowTitle("Connections")
        self.setMinimumWidth(640)
        self._editing: int | None = NEW
        self._job = 0  # the newest listing; older answers are ignored

        self.list = QtWidgets.QListWidget(objectName="connectionList")
        self.list.currentItemChanged.connect(self._on_selected)
        add = QtWidgets.QPushButton("Add", objectName="addConnection")
        add.clicked.connect(self.start_new)
        self.remove_button = QtWidgets.QPushButton("Remove", objectName="removeConnection")
        self.remove_button.clicked.connect(self.remove_current)
        left = QtWidgets.QVBoxLayout()
        left.addWidget(self.list)
        row = QtWidgets.QHBoxLayout()
        row.addWidget(add)
        row.addWidget(self.remove_button)
        left.addLayout(row)

        self.name = QtWidgets.QLineEdit(objectName="connectionName")
        self.name.setPlaceholderText("e.g. My vLLM")
        self.base_url = QtWidgets.QLineEdit(objectName="connectionUrl")
        self.base_url.setPlaceholderText("http://gpu-box:8000/v1")
        self.use_keychain = QtWidgets.QRadioButton("Keep the API key in the system keychain",
                                                   objectName="useKeychain")
        self.use_env = QtWidgets.QRadioButton("Read the API key from an environment variable",
                                              objectName="useEnv")
        self.api_key = QtWidgets.QLineEdit(objectName="connectionKey")
        self.api_key.setEchoMode(QtWidgets.QLineEdit.Password)
        self.env_name = QtWidgets.QLineEdit(objectName="connectionEnv")
        self.env_name.setPlaceholderText("FERROX_API_KEY")
        self.session_header = QtWidgets.QLineEdit(DEFAULT_SESSION_HEADER, objectName="sessionHeader")
        self.session_header.setToolTip("Sent with every request of a chat, so a prefix-aware "
                                       "router (SGLang router, vLLM production-stack) keeps the "
                                       "chat on one worker")
        self.context_sizes = QtWidgets.QPlainTextEdit(objectName="contextSizes")
        self.context_sizes.setPlaceholderText("model = tokens, one a line (empty: what the server "
                                              "says, else 8192)")
        self.context_sizes.setMaximumHeight(70)
        self.use_keychain.toggled.connect(self._show_key_mode)
        self.keychain_note = QtWidgets.QLabel(wordWrap=True)
        problem = connections.keychain.problem()
        self.keychain_note.setText(problem or "")
        self.keychain_note.setVisible(bool(problem))
        (self.use_env if problem else self.use_keychain).setChecked(True)
        self._show_key_mode()

        form = QtWidgets.QFormLayout()
        form.addRow("Name:", self.name)
        form.addRow("Base URL:", self.base_url)
        form.addRow(self.use_keychain)
        form.addRow("API key:", self.api_key)
        form.addRow(self.use_env)
        form.addRow("Variable:", self.env_name)
        form.addRow(self.keychain_note)
        form.addRow("Session header:", self.session_header)
        form.addRow("Context sizes:", self.context_sizes)

        self.save_button = QtWidgets.QPushButton("Save", objectName="saveConnection")
        self.save_button.clicked.connect(self.save)
        self.test_button = QtWidgets.QPushButton("Test", objectName="testConnection")
        self.test_button.setToolTip("Ask the server for its models")
        self.test_button.clicked.connect(self.test)
        buttons = QtWidgets.QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.test_button)
        buttons.addWidget(self.save_button)
        self.status = QtWidgets.QLabel(objectName="connectionStatus", wordWrap=True)
        self.status.setTextInteractionFlags(Qt.TextSelectableByMouse)

        right = QtWidgets.QVBoxLayout()
        right.addLayout(form)
        right.addLayout(buttons)
        right.addWidget(self.status)
        right.addStretch(1)
        close = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.Close)
        close.rejected.connect(self.reject)
        body = QtWidgets.QHBoxLayout()
        body.addLayout(left, 2)
        body.addLayout(right, 3)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addLayout(body)
        layout.addWidget(close)
        self.refresh()

    # -- the list ----------------------------------------------------------------------

    def refresh(self, select: int | None = None) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        try:
            saved = self.connections.list_connections()
        except StorageError as exc:
            saved = []
            self._say(str(exc), error=True)
        for connection in saved:
            item = QtWidgets.QListWidgetItem(f"{connection.name}\n{connection.base_url}")
            item.setData(Qt.UserRole, connection.id)
            self.list.addItem(item)
            if connection.id == select:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        self.remove_button.setEnabled(self.list.currentItem() is not None)
        if select is None:
            self.start_new()
        else:
            self._editing = select  # the form now edits the saved connection

    def start_new(self) -> None:
        self._editing = NEW
        self.list.setCurrentRow(-1)
        for field in (self.name, self.base_url, self.api_key, self.env_name, self.context_sizes):
            field.clear()
        self.session_header.setText(DEFAULT_SESSION_HEADER)
        self.api_key.setPlaceholderText("none")
        self._say("")
        self.name.setFocus()

    def _on_selected(self, current, _previous) -> None:
        self.remove_button.setEnabled(current is not None)
        if current is None:
            return
        try:
            connection = self.connections.get_connection(current.data(Qt.UserRole))
        except StorageError as exc:
            self._say(str(exc), error=True)
            return
        self._editing = connection.id
        self.name.setText(connection.name)
        self.base_url.setText(connection.base_url)
        self.api_key.clear()
        self.api_key.setPlaceholderText("unchanged (type a new key to replace it)")
        self.env_name.setText(connection.api_key_env or "")
        self.session_header.setText(connection.session_header)
        self.context_sizes.setPlainText(format_context_sizes(connection.context_sizes))
        (self.use_env if connection.api_key_env else self.use_keychain).setChecked(True)
        self._say("")

    def _show_key_mode(self) -> None:
        keychain = self.use_keychain.isChecked()
        self.api_key.setEnabled(keychain)
        self.env_name.setEnabled(not keychain)

    # -- save, remove, test ------------------------------------------------------------

    def save(self) -> bool:
        """Add or update the connection in the form; then fetch its models in the background."""
        env = self.env_name.text().strip() if self.use_env.isChecked() else ""
        key = self.api_key.text() if self.use_keychain.isChecked() else ""
        try:
            extra = {"session_header": self.session_header.text(),
                     "context_sizes": parse_context_sizes(self.context_sizes.toPlainText())}
            if self._editing is NEW:
                saved = self.connections.add_connection(
                    self.name.text(), self.base_url.text(), api_key=key or None,
                    api_key_env=env or None, **extra)
            else:
                saved = self.connections.update_connection(
                    self._editing, name=self.name.text(), base_url=self.base_url.text(),
                    api_key_env=env or None, **extra)
                if env:
                    self.connections.set_api_key(saved.id, None)  # the variable replaces it
                elif key.strip():
                    self.connections.set_api_key(saved.id, key)
        except StorageError as exc:
            self._say(str(exc), error=True)
            return False
        self.api_key.clear()  # the key is in the keychain now, not in a widget
        self.refresh(select=saved.id)
        self.changed.emit()
        self.saved.emit(saved.id)
        self._say(f"Saved {saved.name}. Asking the server for its models…")
        self._list_models(saved.id)
        return True

    def remove_current(self) -> None:
        item = self.list.currentItem()
        if item is None:
            return
        connection_id = item.data(Qt.UserRole)
        try:
            self.connections.remove_connection(connection_id)
            forget_models(self.settings, connection_id)
        except StorageError as exc:
            self._say(str(exc), error=True)
            return
        self.refresh()
        self.changed.emit()
        self._say("Removed; its key was deleted from the keychain.")

    def test(self) -> None:
        """List the server's models with what the form says now (saved or not)."""
        self._say("Asking the server for its models…")
        self._list_models(self._editing, from_form=True)

    def _form(self) -> dict:
        """What the form says, as plain data for the background job."""
        return {"base_url": self.base_url.text(), "name": self.name.text().strip(),
                "env": self.env_name.text().strip() if self.use_env.isChecked() else "",
                "key": self.api_key.text().strip() if self.use_keychain.isChecked() else ""}

    def _list_models(self, connection_id: int | None, from_form: bool = False) -> None:
        form = self._form() if from_form else None
        self._job += 1
        job = self._job
        self.test_button.setEnabled(False)
        # The keychain may be slow (or ask the person): it is read in the job too.
        run_in_background(lambda: self._fetch(connection_id, form),
                          lambda answer: self._on_models(job, connection_id, *answer),
                          lambda exc: self._on_list_failed(job, exc))

    def _fetch(self, connection_id: int | None, form: dict | None):
        """Off the GUI thread: (settings used, models). Raises BaseUrlError, StorageError
        (a missing variable, a keychain failure) or BackendError."""
        saved = self.connections.get_connection(connection_id) if connection_id is not NEW else None
        if form is None:
            settings = RemoteSettings(saved.base_url, api_key=self.connections.api_key(saved),
                                      name=saved.name)
        else:
            if form["env"]:
                key = os.environ.get(form["env"])
                if not key:
                    raise StorageError(f"The environment variable {form['env']} is not set, so "
                                       "there is no API key to send.")
            else:
                key = form["key"] or None
                if key is None and saved is not None and not saved.api_key_env:
                    key = self.connections.api_key(saved)  # the stored one, unchanged
            settings = RemoteSettings(form["base_url"], api_key=key, name=form["name"])
        return settings, fetch_models(settings)

    def _on_models(self, job: int, connection_id, settings: RemoteSettings, models) -> None:
        if job != self._job:
            return
        self.test_button.setEnabled(True)
        names = ", ".join(m.name for m in models[:SHOWN_MODELS])
        more = f" and {len(models) - SHOWN_MODELS} more" if len(models) > SHOWN_MODELS else ""
        text = (f"Connected: {len(models)} model{'s' * (len(models) != 1)}"
                f"{': ' + names + more if models else ' (the server lists none)'}.")
        if connection_id is not NEW:
            try:
                saved = self.connections.get_connection(connection_id)
            except StorageError:
                saved = None
            if saved is not None and saved.base_url == settings.base_url:
                remember_models(self.settings, connection_id, models)
                self.changed.emit()
                text += " They are in the model picker."
        self._say(text)

    def _on_list_failed(self, job: int, exc: Exception) -> None:
        if job != self._job:
            return
        self.test_button.setEnabled(True)
        if isinstance(exc, (BackendError, StorageError, BaseUrlError)):
            self._say(str(exc), error=True)
        else:  # a bug: still said, never raised into the event loop
            self._say(f"Listing the models failed unexpectedly: {type(exc).__name__}: {exc}", error=True)

    def _say(self, text: str, error: bool = False) -> None:
        self.status.setText(text)
        self.status.setProperty("error", error)
        self.status.setStyleSheet("color: #b00020;" if error else "")

    def is_busy(self) -> bool:
        return not self.test_button.isEnabled()
