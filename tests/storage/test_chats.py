"""Chats: create, list (order, search), rename, pin, model, settings, soft delete and undo."""

from __future__ import annotations

import dataclasses

import pytest

from app.storage import DEFAULT_TITLE, StorageError


def _titles(chats):
    return [c.title for c in chats]


def test_create_chat_defaults(store):
    chat = store.create_chat()
    assert chat.title == DEFAULT_TITLE
    assert (chat.pinned, chat.deleted, chat.model, chat.settings, chat.head_message_id) == (False, False, None, {}, None)
    assert chat.created_at == chat.updated_at
    assert store.get_chat(chat.id) == chat


def test_records_are_frozen_and_their_dicts_are_copies(store):
    chat = store.create_chat(settings={"temperature": 0.7})
    with pytest.raises(dataclasses.FrozenInstanceError):
        chat.title = "x"
    chat.settings["temperature"] = 2.0
    assert store.get_chat(chat.id).settings == {"temperature": 0.7}
    assert hash(chat)  # hashable despite the dict


def test_get_a_missing_chat_is_a_plain_error(store):
    with pytest.raises(StorageError, match="no chat with id 42"):
        store.get_chat(42)


def test_list_is_pinned_first_then_most_recently_updated(store):
    old, middle, new = (store.create_chat(t) for t in ("old", "middle", "new"))
    assert _titles(store.list_chats()) == ["new", "middle", "old"]

    store.add_message(old.id, "user", "activity moves a chat up")
    assert _titles(store.list_chats()) == ["old", "new", "middle"]

    store.set_pinned(middle.id, True)
    assert _titles(store.list_chats()) == ["middle", "old", "new"]
    assert store.get_chat(middle.id).pinned


def test_rename_tidies_the_title_and_refuses_an_empty_one(store):
    chat = store.create_chat()
    assert store.rename_chat(chat.id, "  Trip\nplans  ").title == "Trip plans"
    with pytest.raises(StorageError, match="cannot be empty"):
        store.rename_chat(chat.id, "   ")


def test_search_matches_titles_and_message_text_ignoring_case(store):
    recipes = store.create_chat("Recipes")
    travel = store.create_chat("Travel")
    store.add_message(travel.id, "user", "What to see in KRAKÓW?")
    other = store.create_chat("Other")
    store.add_message(other.id, "user", "100% sure_thing in C:\\Temp")

    assert _titles(store.list_chats("recip")) == ["Recipes"]
    assert _titles(store.list_chats("kraków")) == ["Travel"]  # non-ASCII case folding
    assert _titles(store.list_chats("  SEE IN ")) == ["Travel"]
    assert _titles(store.list_chats("0% s")) == ["Other"]  # % and _ are plain characters
    assert _titles(store.list_chats("_")) == ["Other"]
    assert _titles(store.list_chats("c:\\temp")) == ["Other"]
    assert _titles(store.list_chats("ÓW")) == ["Travel"]
    assert store.list_chats("nowhere") == []
    assert len(store.list_chats("")) == 3
    assert recipes.id in [c.id for c in store.list_chats("")]


def test_search_finds_text_in_versions_not_shown(store):
    chat = store.create_chat("Plain")
    store.add_message(chat.id, "user", "q")
    reply = store.add_message(chat.id, "assistant", "an answer about zebras")
    store.add_version(reply.id, "a different answer")
    assert _titles(store.list_chats("zebra")) == ["Plain"]


def test_search_leaves_out_deleted_chats(store):
    chat = store.create_chat("Secret plans")
    store.delete_chat(chat.id)
    assert store.list_chats("secret") == []


def test_soft_delete_and_restore_puts_the_chat_back_as_it_was(store):
    first = store.create_chat("first")
    store.add_message(first.id, "user", "kept while deleted")
    second = store.create_chat("second")

    deleted = store.delete_chat(first.id)
    assert deleted.deleted and deleted.updated_at == first.updated_at + 2  # only the message touched it
    assert _titles(store.list_chats()) == ["second"]
    assert store.get_chat(first.id).deleted

    restored = store.restore_chat(first.id)
    assert not restored.deleted
    assert _titles(store.list_chats()) == ["second", "first"]
    assert [m.content for m in store.active_path(first.id)] == ["kept while deleted"]
    assert second.id != first.id


def test_purge_removes_only_chats_deleted_long_enough_ago(store, clock):
    old = store.create_chat("deleted long ago")
    store.add_message(old.id, "user", "gone for good")
    store.delete_chat(old.id)
    clock.advance(3600)
    recent = store.create_chat("deleted just now")
    store.delete_chat(recent.id)
    kept = store.create_chat("not deleted")

    assert store.purge_deleted(older_than_s=600) == 1
    with pytest.raises(StorageError):
        store.get_chat(old.id)
    assert store.get_chat(recent.id).deleted
    assert store._conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 0  # cascaded
    assert store.purge_deleted() == 1
    assert _titles(store.list_chats()) == [kept.title]


def test_chat_settings_merge_and_none_restores_the_default(store):
    chat = store.create_chat(settings={"temperature": 0.2, "system_prompt": "Be brief."})
    updated = store.update_chat_settings(chat.id, {"top_k": 40, "temperature": None, "my_key": [1, 2]})
    assert updated.settings == {"system_prompt": "Be brief.", "top_k": 40, "my_key": [1, 2]}
    assert updated.updated_at > chat.updated_at


@pytest.mark.parametrize("bad", [
    {"temperature": -1}, {"temperature": "hot"}, {"top_p": 0}, {"top_p": 1.5}, {"min_p": 2},
    {"top_k": 2.5}, {"max_tokens": 0}, {"seed": True}, {"system_prompt": 3},
    {"temperature": float("nan")}, {"weird": object()}, {1: "x"},
])
def test_bad_settings_are_refused_with_a_plain_error(store, bad):
    chat = store.create_chat()
    with pytest.raises(StorageError):
        store.update_chat_settings(chat.id, bad)
    with pytest.raises(StorageError):
        store.create_chat(settings=bad)
    assert store.get_chat(chat.id).settings == {}


def test_chat_model_can_be_set_and_cleared(store):
    chat = store.create_chat(model="gemma3-270m")
    assert chat.model == "gemma3-270m"
    assert store.set_chat_model(chat.id, "/models/other.gguf").model == "/models/other.gguf"
    assert store.set_chat_model(chat.id, None).model is None
