"""Which backend serves a model picker key, and the picker's remote entries. Qt-free.

The picker holds one key per entry: a local model's path or built-in key, or, for a model
on a saved connection, `<kind prefix><connection id>:<model name>` (`remote:3:llama3`); the
kinds and their key prefixes are declared in app/backends/registry.py. `route(key)` is the
one place that tells them apart; the controller and the bridge ask it and nothing else.

The model names a connection offers are remembered in the app settings (`remote_models:<id>`,
a list of [name, context or null]) whenever the server's list is fetched (the Connections
dialog's Test and Save), so the picker fills at start-up without waiting on the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.backends.registry import parse_picker_key, picker_key
from app.backends.remote import RemoteBackend, RemoteModel, RemoteSettings

# The context assumed for a remote model whose server does not say and whose size the person
# has not set (the meter and document fitting need a figure; the server has the last word).
DEFAULT_REMOTE_CONTEXT = 8192


@dataclass(frozen=True)
class Route:
    kind: str  # a kind of app/backends/registry.py: "local", "remote", ...
    key: str
    connection_id: int | None = None  # None for the local kind
    model: str = ""
    needs_local_model: bool = True  # this process's engine serves it (loading a model file)


def remote_key(connection_id: int, model: str) -> str:
    return picker_key("remote", connection_id, model)


def route(key: str | None) -> Route:
    """Which backend serves picker key `key`. Anything not a well-formed key of a connection's
    kind is local (paths, built-in keys), so local models are never affected by this module."""
    kind, connection_id, model = parse_picker_key(key)
    if connection_id is None:
        return Route(kind.name, key or "", needs_local_model=kind.needs_local_model)
    return Route(kind.name, key, connection_id, model, kind.needs_local_model)


def models_setting(connection_id: int) -> str:
    return f"remote_models:{connection_id}"


def remember_models(settings, connection_id: int, models: list[RemoteModel]) -> None:
    """`settings`: anything with get_setting/set_setting (the ChatStore)."""
    settings.set_setting(models_setting(connection_id), [[m.name, m.context_length] for m in models])


def known_models(settings, connection_id: int) -> list[tuple[str, int | None]]:
    stored = settings.get_setting(models_setting(connection_id), []) or []
    return [(str(entry[0]), entry[1] if isinstance(entry[1], int) else None)
            for entry in stored if isinstance(entry, list) and len(entry) == 2]


def forget_models(settings, connection_id: int) -> None:
    settings.set_setting(models_setting(connection_id), [])


@dataclass(frozen=True)
class PickerEntry:
    key: str
    label: str
    tooltip: str


def picker_label(model: str, connection_name: str) -> str:
    return f"{model} — {connection_name} (remote)"


def picker_entries(connections, settings) -> list[PickerEntry]:
    """Every remembered model of every connection, in the connections' order.
    `connections`: the saved Connections (ConnectionStore.list_connections())."""
    entries = []
    for connection in connections:
        for name, _context in known_models(settings, connection.id):
            entries.append(PickerEntry(remote_key(connection.id, name),
                                       picker_label(name, connection.name),
                                       f"{name} on {connection.base_url}"))
    return entries


def known_context(connection, settings, model: str) -> int | None:
    """The person's size for the model, else the server's, else None (nobody said)."""
    return (connection.context_sizes.get(model)
            or dict(known_models(settings, connection.id)).get(model) or None)


def context_for(connection, settings, model: str) -> int:
    """known_context, else DEFAULT_REMOTE_CONTEXT (for the meter and document fitting)."""
    return known_context(connection, settings, model) or DEFAULT_REMOTE_CONTEXT


@dataclass(frozen=True)
class RemoteModelInfo:
    """A chosen model of a connection's kind (remote, ...), in the shape of the engine's
    ModelInfo (the fields the window reads), so the controller treats it like a loaded local
    one. `architecture` and `dtype` hold the kind's name."""

    path: str  # the picker key
    name: str
    device: str  # where it runs, e.g. "My vLLM (gpu-box:8000)"
    context_length: int
    architecture: str = "remote"
    dtype: str = "remote"
    load_seconds: float = 0.0
    policy_label: str = ""
    policy_reason: str = ""
    decode_step: str = ""  # no local decode step: the tooltip and self-test say nothing of it


def fetch_models(settings: RemoteSettings) -> list[RemoteModel]:
    """The server's model list (blocking: call it off the GUI thread). BackendError with a
    readable message on any failure."""
    backend = RemoteBackend(settings)
    try:
        return backend.list_models()
    finally:
        backend.close()
