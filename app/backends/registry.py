"""The kinds of backend, by name: the one line to add for a new kind.

Entries are "module:Class" so that naming a kind imports nothing: the remote backend does not
pull in torch, and the local one is imported only when a local model is used.
"""

from __future__ import annotations

import importlib

from app.backends.base import BackendError, ChatBackend

BACKENDS: dict[str, str] = {
    "local": "app.backends.local:LocalBackend",  # this computer's engine (ModelSession)
    "remote": "app.backends.remote:RemoteBackend",  # an OpenAI-compatible server
}


def backend_class(kind: str) -> type:
    try:
        module_name, class_name = BACKENDS[kind].split(":")
    except KeyError:
        raise BackendError(f"Unknown kind of backend {kind!r}; known: {', '.join(sorted(BACKENDS))}.") from None
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(kind: str, **options) -> ChatBackend:
    """A new backend of `kind`, built from its class's own keyword options (LocalBackend:
    session, device, dtype; RemoteBackend: settings)."""
    return backend_class(kind)(**options)
