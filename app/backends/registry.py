"""The kinds of backend, by name: the one line to add for a new kind.

A kind says everything the rest of the app needs to reach it, so nothing outside this table
and the kind's own module names it:
  - `backend`: its ChatBackend class, "module:Class";
  - `build`: how a chosen model becomes a ready backend, "module:function" called as
    `build(connections, connection, model, context_length)` with the ConnectionStore, one of
    its saved Connections, the model's name and its context size (None when neither the
    person nor the server said); it returns a ChatBackend whose `describe()` is that model.
    Empty for the local kind, which the bridge's own ModelSession serves;
  - `key_prefix`: its picker keys are `<key_prefix><connection id>:<model name>` (a model
    name may hold colons); empty for the local kind, whose keys are model paths and built-in
    keys ("builtin:..."), the catch-all for any key no other kind claims;
  - `needs_local_model`: served by this process's engine (a model file loaded with the
    device/dtype settings), so switching to it reloads the engine.

Entries are strings so that naming a kind imports nothing: the remote backend does not pull
in torch, and the local one is imported only when a local model is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from app.backends.base import BackendError, ChatBackend


@dataclass(frozen=True)
class BackendKind:
    name: str
    backend: str  # "module:Class"
    build: str = ""  # "module:function"; "" = the local engine
    key_prefix: str = ""  # "" = the local kind's catch-all keys
    needs_local_model: bool = False


KINDS: dict[str, BackendKind] = {
    "local": BackendKind("local", "app.backends.local:LocalBackend", needs_local_model=True),
    "remote": BackendKind("remote", "app.backends.remote:RemoteBackend",
                          build="app.backends.from_connection:build_remote", key_prefix="remote:"),
}


def _attribute(target: str):
    module_name, name = target.split(":")
    return getattr(importlib.import_module(module_name), name)


def kind_of(name: str) -> BackendKind:
    try:
        return KINDS[name]
    except KeyError:
        raise BackendError(f"Unknown kind of backend {name!r}; known: {', '.join(sorted(KINDS))}.") from None


def local_kind() -> BackendKind:
    """The kind that serves every key no other kind claims (this computer's engine)."""
    return next(kind for kind in KINDS.values() if not kind.key_prefix)


def backend_class(kind: str) -> type:
    return _attribute(kind_of(kind).backend)


def create_backend(kind: str, **options) -> ChatBackend:
    """A new backend of `kind`, built from its class's own keyword options (LocalBackend:
    session, device, dtype; RemoteBackend: settings)."""
    return backend_class(kind)(**options)


def picker_key(kind: str, connection_id: int, model: str) -> str:
    """The picker key of `model` on saved connection `connection_id`, served by `kind`."""
    prefix = kind_of(kind).key_prefix
    if not prefix:
        raise BackendError(f"A {kind} model's key is its path, not a connection's model.")
    return f"{prefix}{connection_id}:{model}"


def parse_picker_key(key: str | None) -> tuple[BackendKind, int | None, str]:
    """(kind, connection id, model name) of picker key `key`. Anything no kind claims with a
    well-formed `<prefix><id>:<model>` is the local kind's (paths, built-in keys), with no
    connection and the key itself as the model."""
    key = key or ""
    for kind in KINDS.values():
        if kind.key_prefix and key.startswith(kind.key_prefix):
            ident, sep, model = key[len(kind.key_prefix):].partition(":")
            if sep and ident.isdigit() and model:
                return kind, int(ident), model
    return local_kind(), None, key


def build_backend(kind: str, connections, connection, model: str,
                  context_length: int | None) -> ChatBackend:
    """A ready backend of `kind` for `model` on `connection` (see the module docstring).
    Raises BackendError (or StorageError, reading the key) with a readable message."""
    builder = kind_of(kind).build
    if not builder:
        raise BackendError(f"A {kind} model is loaded by the engine, not built from a connection.")
    return _attribute(builder)(connections, connection, model, context_length)
