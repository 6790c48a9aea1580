"""The Trash: deleted chats are listed, restored or removed for good, one at a time."""

from __future__ import annotations

import pytest

from app.storage import StorageError


def test_trash_lists_deleted_chats_newest_first_and_purges_one(store):
    keep, first, second = (store.create_chat(t) for t in ("Keep", "First", "Second"))
    store.add_message(first.id, "user", "hello")
    store.delete_chat(first.id)
    store.delete_chat(second.id)
    assert [c.title for c in store.list_deleted_chats()] == ["Second", "First"]
    store.purge_chat(first.id)
    assert [c.title for c in store.list_deleted_chats()] == ["Second"]
    with pytest.raises(StorageError):
        store.get_chat(first.id)
    store.restore_chat(second.id)
    assert store.list_deleted_chats() == []
    assert {c.title for c in store.list_chats()} == {"Keep", "Second"}


def test_a_live_chat_cannot_be_purged(store):
    chat = store.create_chat("Alive")
    with pytest.raises(StorageError, match="Trash"):
        store.purge_chat(chat.id)
    assert store.get_chat(chat.id).title == "Alive"
