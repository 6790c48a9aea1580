"""A saved connection (app/storage/connections.py) made into a RemoteBackend."""

from __future__ import annotations

from app.backends.remote import RemoteBackend, RemoteSettings


def remote_backend_for(store, connection) -> RemoteBackend:
    """`store`: a ConnectionStore; `connection`: one of its Connections. The API key is read
    from the keychain (or the connection's environment variable) here, and held only in the
    backend's HTTP client; StorageError when the variable is missing or the keychain fails."""
    return RemoteBackend(RemoteSettings(
        connection.base_url, api_key=store.api_key(connection),
        session_header=connection.session_header, context_sizes=dict(connection.context_sizes),
        extended_sampling=connection.extended_sampling, name=connection.name))


def build_remote(store, connection, model: str, context_length: int | None) -> RemoteBackend:
    """The remote kind's builder (app/backends/registry.py): a RemoteBackend on `connection`
    with `model` chosen, without asking the server (it may be down now; a chat remembers its
    model, and a wrong name shows on the first reply)."""
    backend = remote_backend_for(store, connection)
    backend.use_model(model, context_length)
    return backend
