"""Remote server connections: name, base URL, session header, per-model context sizes.

The API key is never in this database, nor in a log or a repr. It lives in the OS keychain
(`keyring`: macOS Keychain, Windows Credential Locker, the Secret Service on Linux) under the
service "ferrox-chat" and the connection's random `key_ref`; or the connection names an
environment variable (`api_key_env`) that holds it -- the only way where no keychain exists
(a headless Linux box, CI), which `keychain_problem()` says in words.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from app.backends.base_url import BaseUrlError, normalize_base_url
from app.storage.base import StoreBase
from app.storage.errors import StorageError

KEYCHAIN_SERVICE = "ferrox-chat"
DEFAULT_SESSION_HEADER = "X-Session-ID"
MAX_NAME_CHARS = 80
MAX_CONTEXT = 100_000_000
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an HTTP token (RFC 9110)
_RESERVED_HEADERS = {"authorization", "content-type", "content-length", "host", "accept",
                     "transfer-encoding", "connection"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class KeychainUnavailable(StorageError):
    """No OS keychain can hold an API key here; the message says what to do instead."""


@dataclass(frozen=True)
class Connection:
    id: int
    name: str
    base_url: str
    session_header: str
    api_key_env: str | None  # an environment variable holding the key, instead of the keychain
    extended_sampling: bool
    context_sizes: dict[str, int] = field(default_factory=dict)  # model name -> tokens
    key_ref: str = field(default="", repr=False)  # the keychain entry's name (not a secret)
    created_at: float = 0.0


class Keychain:
    """The OS keychain through `keyring`, with every failure made a readable StorageError.
    `backend` is a keyring backend object (None: the one keyring picks for this system)."""

    def __init__(self, backend=None):
        self._backend = backend

    def _keyring(self):
        if self._backend is not None:
            return self._backend
        import keyring

        return keyring.get_keyring()

    def problem(self) -> str | None:
        """None when keys can be stored; else why not, and what to do instead."""
        try:
            from keyring.backends import fail

            backend = self._keyring()
        except Exception as exc:  # noqa: BLE001 -- a broken keyring install is "no keychain"
            return _no_keychain(f"keyring could not start: {exc}")
        if isinstance(backend, fail.Keyring) or getattr(backend, "priority", 1) <= 0:
            return _no_keychain("keyring found no keychain on this system")
        return None

    def get(self, key_ref: str) -> str | None:
        return self._call("read", lambda kr: kr.get_password(KEYCHAIN_SERVICE, key_ref))

    def set(self, key_ref: str, api_key: str) -> None:
        self._call("save", lambda kr: kr.set_password(KEYCHAIN_SERVICE, key_ref, api_key))

    def delete(self, key_ref: str) -> None:
        from keyring.errors import PasswordDeleteError

        def delete(kr):
            try:
                kr.delete_password(KEYCHAIN_SERVICE, key_ref)
            except PasswordDeleteError:
                pass  # nothing stored: nothing to delete
        self._call("delete", delete)

    def _call(self, verb: str, action):
        problem = self.problem()
        if problem is not None:
            raise KeychainUnavailable(problem)
        from keyring.errors import KeyringError

        try:
            return action(self._keyring())
        except KeyringError as exc:  # e.g. a locked keychain, a refused prompt
            # The message names the failure only: keyring errors never include the secret.
            raise KeychainUnavailable(f"The system keychain could not {verb} the API key "
                                      f"({type(exc).__name__}: {exc}).") from None


def _no_keychain(reason: str) -> str:
    return (f"No system keychain is available ({reason}), so an API key cannot be stored "
            "safely. Put the key in an environment variable and give the variable's name "
            "instead (for example FERROX_API_KEY).")


class ConnectionStore(StoreBase):
    """Connections in the chat database (see the module docstring for where keys go)."""

    def __init__(self, location=None, *, keychain: Keychain | None = None, **kwargs):
        super().__init__(location, **kwargs)
        self.keychain = keychain or Keychain()

    def add_connection(self, name: str, base_url: str, *, api_key: str | None = None,
                       api_key_env: str | None = None, session_header: str = DEFAULT_SESSION_HEADER,
                       context_sizes: Mapping[str, int] | None = None,
                       extended_sampling: bool = True) -> Connection:
        """Save a connection; `api_key` goes to the keychain (KeychainUnavailable where there
        is none: give `api_key_env` instead). Nothing is saved if any part fails."""
        values = _checked(name=name, base_url=base_url, session_header=session_header,
                          api_key_env=api_key_env, context_sizes=context_sizes or {},
                          extended_sampling=extended_sampling)
        if api_key is not None and api_key.strip() and (problem := self.keychain.problem()):
            raise KeychainUnavailable(problem)
        key_ref = f"connection-{uuid.uuid4().hex}"
        with self._write() as conn:
            self._refuse_duplicate(conn, values["name"], None)
            cursor = conn.execute(
                "INSERT INTO connections (name, base_url, session_header, api_key_env, "
                "extended_sampling, context_sizes, key_ref, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (values["name"], values["base_url"], values["session_header"], values["api_key_env"],
                 int(values["extended_sampling"]), json.dumps(values["context_sizes"]), key_ref,
                 self._now()))
            if api_key is not None and api_key.strip():
                self.keychain.set(key_ref, api_key.strip())  # a failure here rolls the row back
            return self._connection_row(conn, cursor.lastrowid)

    def update_connection(self, connection_id: int, **changes: Any) -> Connection:
        """Change name, base_url, session_header, api_key_env, context_sizes (replaced
        whole) or extended_sampling. The key has its own call, `set_api_key`."""
        unknown = sorted(set(changes) - {"name", "base_url", "session_header", "api_key_env",
                                         "context_sizes", "extended_sampling"})
        if unknown:
            raise StorageError(f"Unknown connection settings: {', '.join(unknown)}.")
        values = _checked(**changes)
        with self._write() as conn:
            self._connection_row(conn, connection_id)
            if "name" in values:
                self._refuse_duplicate(conn, values["name"], connection_id)
            for column, value in values.items():
                stored = json.dumps(value) if column == "context_sizes" else (
                    int(value) if column == "extended_sampling" else value)
                conn.execute(f"UPDATE connections SET {column} = ? WHERE id = ?", (stored, connection_id))
            return self._connection_row(conn, connection_id)

    def set_context_size(self, connection_id: int, model: str, tokens: int | None) -> Connection:
        """The person's context size for one model (None: forget it, use the server's)."""
        sizes = dict(self.get_connection(connection_id).context_sizes)
        if tokens is None:
            sizes.pop(model, None)
        else:
            sizes[model] = tokens
        return self.update_connection(connection_id, context_sizes=sizes)

    def set_api_key(self, connection_id: int, api_key: str | None) -> None:
        """Store (or, with None or blank, delete) the connection's key in the keychain."""
        connection = self.get_connection(connection_id)
        if api_key is None or not api_key.strip():
            self.keychain.delete(connection.key_ref)
        else:
            self.keychain.set(connection.key_ref, api_key.strip())

    def api_key(self, connection: Connection) -> str | None:
        """The key to send: from `api_key_env` when set, else the keychain; None for none."""
        if connection.api_key_env:
            value = os.environ.get(connection.api_key_env)
            if not value:
                raise StorageError(f"The connection {connection.name!r} takes its API key from the "
                                   f"environment variable {connection.api_key_env}, which is not set.")
            return value
        if self.keychain.problem() is not None:
            return None  # nothing can have been stored there
        return self.keychain.get(connection.key_ref)

    def get_connection(self, connection_id: int) -> Connection:
        with self._read() as conn:
            return self._connection_row(conn, connection_id)

    def list_connections(self) -> list[Connection]:
        with self._read() as conn:
            return [_from_row(row) for row in conn.execute("SELECT * FROM connections ORDER BY name, id")]

    def remove_connection(self, connection_id: int) -> None:
        """Forget the connection and delete its key from the keychain."""
        connection = self.get_connection(connection_id)
        if self.keychain.problem() is None:
            self.keychain.delete(connection.key_ref)
        with self._write() as conn:
            conn.execute("DELETE FROM connections WHERE id = ?", (connection_id,))

    def _connection_row(self, conn: sqlite3.Connection, connection_id: int) -> Connection:
        row = conn.execute("SELECT * FROM connections WHERE id = ?", (connection_id,)).fetchone()
        if row is None:
            raise StorageError(f"There is no connection with id {connection_id}.")
        return _from_row(row)

    @staticmethod
    def _refuse_duplicate(conn: sqlite3.Connection, name: str, own_id: int | None) -> None:
        row = conn.execute("SELECT id FROM connections WHERE name = ?", (name,)).fetchone()
        if row is not None and row["id"] != own_id:
            raise StorageError(f"There is already a connection named {name!r}; choose another name.")


def _from_row(row: sqlite3.Row) -> Connection:
    return Connection(row["id"], row["name"], row["base_url"], row["session_header"],
                      row["api_key_env"], bool(row["extended_sampling"]),
                      json.loads(row["context_sizes"]), row["key_ref"], row["created_at"])


def _checked(**values: Any) -> dict[str, Any]:
    """The settings given, checked and put in their stored form."""
    out = dict(values)
    if "name" in values:
        name = (values["name"] or "").strip()
        if not name or len(name) > MAX_NAME_CHARS:
            raise StorageError(f"A connection's name must be 1 to {MAX_NAME_CHARS} characters.")
        out["name"] = name
    if "base_url" in values:
        try:
            out["base_url"] = normalize_base_url(values["base_url"])
        except BaseUrlError as exc:
            raise StorageError(str(exc)) from None
    if "session_header" in values:
        header = (values["session_header"] or "").strip()
        if not _HEADER_NAME.match(header) or header.lower() in _RESERVED_HEADERS:
            raise StorageError(f"{header!r} cannot be the session header: use letters, digits and "
                               "dashes, and not a standard header (e.g. X-Session-ID).")
        out["session_header"] = header
    if "api_key_env" in values:
        env = (values["api_key_env"] or "").strip() or None
        if env is not None and not _ENV_NAME.match(env):
            raise StorageError(f"{env!r} is not an environment variable name (letters, digits and _; "
                               "for example FERROX_API_KEY).")
        out["api_key_env"] = env
    if "context_sizes" in values:
        out["context_sizes"] = _checked_context_sizes(values["context_sizes"])
    if "extended_sampling" in values:
        out["extended_sampling"] = bool(values["extended_sampling"])
    return out


def _checked_context_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(sizes, Mapping):
        raise StorageError("Context sizes must map model names to numbers of tokens.")
    for model, tokens in sizes.items():
        if not isinstance(model, str) or not model:
            raise StorageError("A context size needs the model's name.")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= MAX_CONTEXT:
            raise StorageError(f"The context size of {model!r} must be a whole number of tokens "
                               f"from 1 to {MAX_CONTEXT:,}, not {tokens!r}.")
    return dict(sizes)
