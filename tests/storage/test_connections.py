"""Connections: settings in SQLite, the API key only in the keychain (or an env variable)."""

from __future__ import annotations

import logging
import sqlite3

import pytest
from keyring.backend import KeyringBackend
from keyring.backends import fail
from keyring.errors import PasswordDeleteError, PasswordSetError

from app.storage import StorageError
from app.storage.connections import (KEYCHAIN_SERVICE, ConnectionStore, Keychain,
                                     KeychainUnavailable)

SECRET = "sk-live-DO-NOT-STORE-4242"


class MemoryKeyring(KeyringBackend):
    """A stand-in for the OS keychain: a dict, so the test can see what was stored."""

    priority = 1

    def __init__(self):
        super().__init__()
        self.entries: dict[tuple[str, str], str] = {}
        self.refuse = False

    def get_password(self, service, username):
        return self.entries.get((service, username))

    def set_password(self, service, username, password):
        if self.refuse:
            raise PasswordSetError("the keychain is locked")
        self.entries[(service, username)] = password

    def delete_password(self, service, username):
        if (service, username) not in self.entries:
            raise PasswordDeleteError("not found")
        del self.entries[(service, username)]


@pytest.fixture
def keyring_memory():
    return MemoryKeyring()


@pytest.fixture
def store(keyring_memory, clock):
    with ConnectionStore(keychain=Keychain(keyring_memory), clock=clock) as opened:
        yield opened


def database_bytes(store) -> bytes:
    """Everything SQLite holds: the file, its write-ahead log, and a full dump."""
    data = store.path.read_bytes()
    wal = store.path.with_name(store.path.name + "-wal")
    if wal.exists():
        data += wal.read_bytes()
    conn = sqlite3.connect(store.path)
    data += "\n".join(conn.iterdump()).encode()
    conn.close()
    return data


def test_key_goes_to_the_keychain_and_never_into_sqlite_or_logs(store, keyring_memory, caplog):
    caplog.set_level(logging.DEBUG)
    conn = store.add_connection("GPU box", "http://gpu-box:8000", api_key=SECRET,
                                context_sizes={"meta-llama/Llama-3.3-70B-Instruct": 32768})
    assert conn.base_url == "http://gpu-box:8000/v1" and conn.session_header == "X-Session-ID"
    assert keyring_memory.entries == {(KEYCHAIN_SERVICE, conn.key_ref): SECRET}
    assert store.api_key(conn) == SECRET
    assert SECRET.encode() not in database_bytes(store)
    assert SECRET not in repr(conn) and SECRET not in repr(store.list_connections())
    assert SECRET not in caplog.text
    store.set_api_key(conn.id, "sk-new")
    assert store.api_key(conn) == "sk-new" and b"sk-new" not in database_bytes(store)


def test_connection_round_trip_and_update(store):
    conn = store.add_connection("vLLM", "https://llm.example.org/v1/", session_header="X-Affinity")
    assert store.get_connection(conn.id) == conn and store.api_key(conn) is None
    changed = store.update_connection(conn.id, name="vLLM prod", extended_sampling=False)
    assert (changed.name, changed.extended_sampling, changed.base_url) == ("vLLM prod", False,
                                                                          "https://llm.example.org/v1")
    changed = store.set_context_size(conn.id, "qwen", 65536)
    assert changed.context_sizes == {"qwen": 65536}
    assert store.set_context_size(conn.id, "qwen", None).context_sizes == {}
    assert [c.name for c in store.list_connections()] == ["vLLM prod"]


@pytest.mark.parametrize("url, message", [
    ("ftp://box/v1", "must start with http:// or https://"),
    ("gpu-box:8000", "must start with http:// or https://"),
    ("http:///v1", "no valid server name"),
    ("http://box:99999/v1", "port that is not a number"),
    ("http://user:sk-1@box/v1", "not in the base URL"),
    ("", "The base URL is empty"),
])
def test_bad_base_urls_are_refused_and_nothing_saved(store, url, message):
    with pytest.raises(StorageError, match=message):
        store.add_connection("x", url)
    assert store.list_connections() == []


@pytest.mark.parametrize("changes, message", [
    ({"session_header": "Authorization"}, "cannot be the session header"),
    ({"session_header": "X Session"}, "cannot be the session header"),
    ({"api_key_env": "1KEY"}, "not an environment variable name"),
    ({"context_sizes": {"m": 0}}, "from 1 to"),
    ({"context_sizes": {"m": "4k"}}, "whole number"),
    ({"name": "  "}, "name must be 1 to 80"),
    ({"colour": "red"}, "Unknown connection settings: colour"),
])
def test_bad_settings_are_refused(store, changes, message):
    conn = store.add_connection("ok", "http://box/v1")
    with pytest.raises(StorageError, match=message):
        store.update_connection(conn.id, **changes)
    assert store.get_connection(conn.id) == conn


def test_duplicate_names_are_refused(store):
    store.add_connection("box", "http://box/v1")
    other = store.add_connection("box 2", "http://box2/v1")
    with pytest.raises(StorageError, match="already a connection named 'box'"):
        store.add_connection(" box ", "http://box3/v1")
    with pytest.raises(StorageError, match="already a connection named 'box'"):
        store.update_connection(other.id, name="box")


def test_remove_deletes_the_key_too(store, keyring_memory):
    conn = store.add_connection("box", "http://box/v1", api_key=SECRET)
    store.remove_connection(conn.id)
    assert keyring_memory.entries == {} and store.list_connections() == []
    with pytest.raises(StorageError, match="no connection with id"):
        store.get_connection(conn.id)


def test_a_keychain_refusal_saves_nothing(store, keyring_memory):
    keyring_memory.refuse = True
    with pytest.raises(KeychainUnavailable, match="could not save the API key .*locked"):
        store.add_connection("box", "http://box/v1", api_key=SECRET)
    assert store.list_connections() == []


def test_without_a_keychain_say_so_and_use_an_env_variable(monkeypatch, clock):
    with ConnectionStore(keychain=Keychain(fail.Keyring()), clock=clock) as store:
        problem = store.keychain.problem()
        assert problem.startswith("No system keychain is available")
        assert "environment variable" in problem
        with pytest.raises(KeychainUnavailable, match="No system keychain"):
            store.add_connection("box", "http://box/v1", api_key=SECRET)
        assert store.list_connections() == []
        conn = store.add_connection("box", "http://box/v1", api_key_env="BOX_KEY")
        with pytest.raises(StorageError, match="environment variable BOX_KEY, which is not set"):
            store.api_key(conn)
        monkeypatch.setenv("BOX_KEY", SECRET)
        assert store.api_key(conn) == SECRET
        assert SECRET.encode() not in database_bytes(store)
        store.remove_connection(conn.id)  # no keychain: nothing to delete there, no error


def test_connections_share_the_chat_database(clock, keyring_memory):
    from app.storage import ChatStore

    with ChatStore(clock=clock) as chats:
        chats.create_chat("hello")
        with ConnectionStore(chats.path, keychain=Keychain(keyring_memory), clock=clock) as conns:
            conns.add_connection("box", "http://box/v1")
            assert [c.name for c in conns.list_connections()] == ["box"]
        assert len(chats.list_chats()) == 1
