"""Backends: what runs a chat's model -- this computer's engine or a remote OpenAI-compatible
server -- behind one interface, `ChatBackend` (see `base`). `registry.create_backend(kind, ...)`
builds one; `headless.generate_remote` is the CLI's remote `generate`.

Nothing here imports Qt; only `local` imports the engine (and so torch).
"""

from app.backends.base import BackendError, BackendModel, ChatBackend, Listener

__all__ = ["BackendError", "BackendModel", "ChatBackend", "Listener"]
