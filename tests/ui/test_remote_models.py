"""The picker key's route (Qt-free): remote keys go to a connection, everything else stays local."""

from __future__ import annotations

from app.backends.remote import RemoteModel
from app.storage.connections import ConnectionStore, Keychain
from app.ui.remote_models import (DEFAULT_REMOTE_CONTEXT, context_for, known_context,
                                  picker_entries, remember_models, remote_key, route)
from app.storage import ChatStore
from tests.storage.test_connections import MemoryKeyring


def test_route_tells_remote_keys_from_local_ones():
    key = remote_key(3, "org/model:latest")  # a colon in the name (Ollama tags) survives
    assert route(key).kind == "remote"
    assert (route(key).connection_id, route(key).model) == (3, "org/model:latest")
    for local in ("/models/x.gguf", "builtin:smollm2", "remote:", "remote:x:y", "remote:4:", "", None):
        assert route(local).kind == "local", local


def test_picker_entries_follow_the_remembered_lists_and_context_sizes():
    with ChatStore() as settings, ConnectionStore(settings.path, keychain=Keychain(MemoryKeyring())) as store:
        box = store.add_connection("My vLLM", "http://gpu-box:8000", context_sizes={"b": 4096})
        remember_models(settings, box.id, [RemoteModel("a", 32768), RemoteModel("b", 131072),
                                           RemoteModel("c", None)])
        entries = picker_entries(store.list_connections(), settings)
        assert [e.label for e in entries] == ["a — My vLLM (remote)", "b — My vLLM (remote)",
                                              "c — My vLLM (remote)"]
        assert route(entries[0].key).connection_id == box.id
        box = store.get_connection(box.id)
        assert [context_for(box, settings, m) for m in "abc"] == [32768, 4096, DEFAULT_REMOTE_CONTEXT]
        # What the bridge budgets replies with: only a size someone said (None for "c").
        assert [known_context(box, settings, m) for m in "abc"] == [32768, 4096, None]


def test_context_sizes_are_typed_as_lines():
    import pytest

    from app.storage import StorageError
    from app.ui.connections_dialog import format_context_sizes, parse_context_sizes

    sizes = parse_context_sizes("llama3.3:70b = 32,768\n\n org/model=8192 \n")
    assert sizes == {"llama3.3:70b": 32768, "org/model": 8192}
    assert parse_context_sizes(format_context_sizes(sizes)) == sizes
    with pytest.raises(StorageError, match="line 2"):
        parse_context_sizes("a = 1\nb = lots")
