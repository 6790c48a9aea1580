"""Export to Markdown and JSON; import from JSON."""

from __future__ import annotations

import copy
import json

import pytest

from app.storage import (NewAttachment, StorageError, export_file_name, export_json,
                         export_markdown, import_json)


@pytest.fixture
def branched_chat(store):
    """A chat with attachments, metadata, settings, an edited question and regenerated replies."""
    chat = store.create_chat("Colours", settings={"system_prompt": "Be brief.", "temperature": 0.4},
                             model="gemma3-270m")
    question = store.add_message(chat.id, "user", "Name a colour",
                                 attachments=[NewAttachment("palette.txt", "text", "red green", 3, 9)])
    first = store.add_message(chat.id, "assistant", "Red.", metadata={"model": "gemma3-270m", "tokens_out": 2})
    store.add_version(first.id, "Green.", metadata={"finish_reason": "stop"})
    store.add_message(chat.id, "user", "Another?")
    store.add_message(chat.id, "assistant", "Blu", status="stopped")
    store.switch_version(first.id)
    edited = store.add_version(question.id, "Name a fruit")
    store.add_message(chat.id, "assistant", "", status="error", error="The model ran out of memory.")
    store.switch_version(first.id)
    store.set_pinned(chat.id, True)
    return store.get_chat(chat.id), edited


def _without_ids_and_times(data):
    """Export data with message ids renumbered by position and timestamps removed."""
    data = copy.deepcopy(data)
    position = {m["id"]: n for n, m in enumerate(data["messages"])}
    for m in data["messages"]:
        m["id"], m["parent"] = position[m["id"]], position.get(m["parent"])
        del m["created_at"], m["updated_at"]
    chat = data["chat"]
    chat["head"] = position.get(chat["head"])
    del chat["created_at"], chat["updated_at"]
    return data


def test_markdown_has_the_title_and_the_branch_shown(store, branched_chat):
    chat, _ = branched_chat
    text = export_markdown(store, chat.id)
    assert text == (
        "# Colours\n\n*System prompt:* Be brief.\n\n"
        "## User\n\nName a colour\n\nAttachments: palette.txt\n\n"
        "## Assistant\n\nRed.\n")


def test_markdown_notes_stopped_and_failed_replies(store, branched_chat):
    chat, edited = branched_chat
    store.switch_version(edited.id)
    assert export_markdown(store, chat.id).endswith(
        "## User\n\nName a fruit\n\n## Assistant\n\n\n\n*(error: The model ran out of memory.)*\n")
    store.switch_version(store.versions(edited.id).messages[0].id)
    assert "Blu\n\n*(stopped by the user)*\n" in export_markdown(store, chat.id)


def test_json_holds_the_whole_tree(store, branched_chat):
    chat, _ = branched_chat
    data = export_json(store, chat.id)
    json.dumps(data, allow_nan=False)  # plain JSON
    assert (data["format"], data["version"]) == ("ferrox-chat", 1)
    assert data["chat"]["settings"] == {"system_prompt": "Be brief.", "temperature": 0.4}
    assert data["chat"]["pinned"] is True and data["chat"]["model"] == "gemma3-270m"
    assert len(data["messages"]) == 7
    assert data["messages"][0]["attachments"] == [
        {"name": "palette.txt", "kind": "text", "text": "red green", "token_count": 3, "size_bytes": 9}]
    assert data["chat"]["head"] == data["messages"][1]["id"]


def test_round_trip_is_equal_except_ids_and_times(store, branched_chat):
    chat, _ = branched_chat
    exported = export_json(store, chat.id)
    imported = import_json(store, json.loads(json.dumps(exported)))
    assert imported.id != chat.id
    assert _without_ids_and_times(export_json(store, imported.id)) == _without_ids_and_times(exported)
    assert export_markdown(store, imported.id) == export_markdown(store, chat.id)


def test_a_reply_exported_while_streaming_comes_back_interrupted(store):
    chat = store.create_chat()
    store.add_message(chat.id, "assistant", "partial", status="streaming")
    imported = import_json(store, export_json(store, chat.id))
    assert [m.status for m in store.active_path(imported.id)] == ["interrupted"]


def test_an_empty_chat_round_trips(store):
    chat = store.create_chat("Empty")
    imported = import_json(store, export_json(store, chat.id))
    assert (imported.title, imported.head_message_id, store.active_path(imported.id)) == ("Empty", None, [])


def _broken(store, chat_id, change):
    data = export_json(store, chat_id)
    change(data)
    return data


BAD_EXPORTS = {
    "not a dict": lambda d: d.clear(),
    "other format": lambda d: d.update(format="something-else"),
    "newer version": lambda d: d.update(version=99),
    "no version": lambda d: d.pop("version"),
    "messages not a list": lambda d: d.update(messages={}),
    "no chat": lambda d: d.pop("chat"),
    "bad role": lambda d: d["messages"][3].update(role="wizard"),
    "bad status": lambda d: d["messages"][3].update(status="finished"),
    "content not text": lambda d: d["messages"][3].update(content=42),
    "unknown parent": lambda d: d["messages"][3].update(parent=12345),
    "repeated id": lambda d: d["messages"][3].update(id=d["messages"][0]["id"]),
    "bad attachment": lambda d: d["messages"][0]["attachments"][0].update(size_bytes=-5),
    "bad settings": lambda d: d["chat"]["settings"].update(top_p=7),
    "unknown head": lambda d: d["chat"].update(head=12345),
}


@pytest.mark.parametrize("name", BAD_EXPORTS)
def test_bad_input_is_refused_and_nothing_is_added(store, branched_chat, name):
    chat, _ = branched_chat
    data = _broken(store, chat.id, BAD_EXPORTS[name])
    with pytest.raises(StorageError) as caught:
        import_json(store, data)
    assert str(caught.value)
    assert [c.id for c in store.list_chats()] == [chat.id]
    if name == "newer version":
        assert "newer Ferrox Chat" in str(caught.value)
    if name == "bad role":
        assert "Message 4" in str(caught.value)


def test_import_refuses_non_json_values(store):
    with pytest.raises(StorageError, match="not a Ferrox Chat export"):
        import_json(store, ["a", "list"])


@pytest.mark.parametrize("title, name", [
    ("Write a long story about a…", "Write a long story about a.md"),
    ("a/b\\c: d?", "a_b_c_ d.md"),
    ("Été à Paris", "Été à Paris.md"),
    ("…", "chat.md"),
    ("", "chat.md"),
    ("x" * 80, "x" * 60 + ".md"),
])
def test_an_export_is_offered_a_file_name_made_from_the_title(title, name):
    assert export_file_name(title, ".md") == name
