"""Importing a chat export: hostile files are refused with a ChatImportError (a StorageError)
whose message a person can read, nothing is saved then, and existing chats stay untouched."""

from __future__ import annotations

import json
import os
import threading

import pytest

from app.storage import (ChatImportError, ImportLimits, StorageError, export_json, import_chat_file,
                         import_json, read_chat_export)


@pytest.fixture
def existing(store):
    """One chat already in the store, which no failed import may touch."""
    chat = store.create_chat("Keep me", settings={"temperature": 0.4})
    store.add_message(chat.id, "user", "Hello")
    store.add_message(chat.id, "assistant", "Hi!")
    return chat


def _export(store, chat_id) -> dict:
    return json.loads(json.dumps(export_json(store, chat_id)))


def _write_json(tmp_path, data, name="chat.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _refused_file(store, existing, path, *, limits=ImportLimits()) -> str:
    before = store.list_chats()
    with pytest.raises(ChatImportError) as caught:
        import_chat_file(store, path, limits=limits)
    assert store.list_chats() == before and [m.content for m in store.active_path(existing.id)] == ["Hello", "Hi!"]
    message = str(caught.value)
    assert message and "Traceback" not in message and len(message) < 400, message
    return message


def _refused_data(store, existing, data) -> str:
    before = store.list_chats()
    with pytest.raises(ChatImportError) as caught:
        import_json(store, data)
    assert store.list_chats() == before
    message = str(caught.value)
    assert message and len(message) < 400, message
    return message


def test_a_file_round_trips(store, existing, tmp_path):
    path = _write_json(tmp_path, _export(store, existing.id))
    chat = import_chat_file(store, path)
    assert chat.id != existing.id and chat.title == "Keep me" and chat.settings == {"temperature": 0.4}
    assert [m.content for m in store.active_path(chat.id)] == ["Hello", "Hi!"]


def test_a_worker_thread_can_import(store, existing, tmp_path):
    path = _write_json(tmp_path, _export(store, existing.id))
    results: list = []
    worker = threading.Thread(target=lambda: results.append(import_chat_file(store, path)))
    worker.start()
    worker.join()
    assert len(results) == 1 and [m.content for m in store.active_path(results[0].id)] == ["Hello", "Hi!"]


def test_reading_touches_no_database(store, existing, tmp_path):
    export = read_chat_export(_write_json(tmp_path, _export(store, existing.id)))
    assert [m["content"] for m in export.messages] == ["Hello", "Hi!"]
    assert len(store.list_chats()) == 1


def test_deeply_nested_json_files_are_refused(store, existing, tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    assert "nested too deeply" in _refused_file(store, existing, path)
    data = _export(store, existing.id)
    data["messages"][0]["metadata"] = {"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}
    assert "nested more than 32 levels" in _refused_file(store, existing, _write_json(tmp_path, data))


def test_deeply_nested_values_handed_over_directly_are_refused(store, existing):
    nested: list = []
    for _ in range(100_000):  # deeper than json.dumps can recurse
        nested = [nested]
    data = _export(store, existing.id)
    data["messages"][1]["metadata"] = {"deep": nested}
    assert "nested more than" in _refused_data(store, existing, data)
    data["messages"][1]["metadata"] = {}
    data["chat"]["settings"] = {"extra": nested}
    assert "nested more than" in _refused_data(store, existing, data)


@pytest.mark.parametrize("where", ["parent", "head", "id", "role", "status"])
def test_ids_and_names_that_are_lists_are_refused(store, existing, where):
    data = _export(store, existing.id)
    if where == "head":
        data["chat"]["head"] = [data["messages"][0]["id"]]
    else:
        data["messages"][1][where] = [data["messages"][0]["id"]]
    message = _refused_data(store, existing, data)
    assert where in message and "unhashable" not in message, message


def test_a_file_over_the_size_limit_is_refused_before_reading(store, existing, tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as file:
        file.truncate(ImportLimits().max_file_bytes + 1)  # sparse: nothing is written
    assert "up to 64 MB can be imported" in _refused_file(store, existing, path)


def test_a_message_over_the_size_limit_is_refused(store, existing, tmp_path):
    data = _export(store, existing.id)
    data["messages"][1]["content"] = "x" * 5_000
    message = _refused_file(store, existing, _write_json(tmp_path, data),
                            limits=ImportLimits(max_text_chars=4_000))
    assert "Message 2" in message and "5,000 characters long; the limit is 4,000" in message
    data = _export(store, existing.id)
    data["messages"][0]["attachments"] = [{"name": "a.txt", "kind": "text", "text": "y" * 5_000}]
    with pytest.raises(ChatImportError, match="a.txt"):
        import_json(store, data, limits=ImportLimits(max_text_chars=4_000))


def test_too_many_messages_are_refused(store, existing, tmp_path):
    data = _export(store, existing.id)
    assert "2 messages; at most 1" in _refused_file(store, existing, _write_json(tmp_path, data),
                                                    limits=ImportLimits(max_messages=1))


@pytest.mark.parametrize("change, words", [
    (lambda d: d["messages"][1].update(content="broken \ud800 surrogate"), "broken character"),
    (lambda d: d["messages"][0].update(metadata={"k": "\udfff"}), "broken character"),
    (lambda d: d["messages"][0].update(attachments=[{"name": "a", "kind": "text", "text": "",
                                                     "token_count": 10**30, "size_bytes": 1}]), "token_count"),
    (lambda d: d["messages"][0].update(created_at="yesterday"), "created_at"),
    (lambda d: d["chat"].update(title=["a", "list"]), "title must be text"),
    (lambda d: d["chat"].update(pinned="yes"), "pinned"),
    (lambda d: d["chat"].update(model={"name": "x"}), "model must be text"),
    (lambda d: d["chat"]["settings"].update(temperature=1e-300), "temperature"),
    (lambda d: d["chat"]["settings"].update(repetition_penalty=1e-300), "repetition_penalty"),
    (lambda d: d["chat"]["settings"].update(top_k=-1), "top_k"),
    (lambda d: d["chat"]["settings"].update(seed=1 << 70), "seed"),
    (lambda d: d["chat"]["settings"].update(presence_penalty=1e300), "presence_penalty"),
    (lambda d: d["chat"]["settings"].update(system_prompt=["x"]), "system_prompt"),
], ids=["surrogate-content", "surrogate-metadata", "huge-int", "time-text", "title-list", "pinned-text",
        "model-dict", "tiny-temperature", "tiny-repetition-penalty", "negative-top-k", "huge-seed",
        "huge-penalty", "prompt-list"])
def test_wrong_types_and_values_are_refused(store, existing, tmp_path, change, words):
    data = _export(store, existing.id)
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data), encoding="utf-8")  # ensure_ascii keeps surrogates writable
    assert words in _refused_file(store, existing, path)


@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe{\x00}\x00", "not UTF-8"),
    (b'{"format": "ferrox-chat", ', "not a valid JSON file"),
    (b'{"format": "ferrox-chat", "version": 1, "chat": {"created_at": NaN}, "messages": []}', "NaN"),
    (b"[1, 2, 3]", "not a Ferrox Chat export"),
    (b"", "not a valid JSON file"),
], ids=["utf-16", "cut-short", "nan", "a-list", "empty"])
def test_files_that_are_not_exports_are_refused(store, existing, tmp_path, content, words):
    path = tmp_path / "odd.json"
    path.write_bytes(content)
    assert words in _refused_file(store, existing, path)


def test_folders_missing_files_and_pipes_are_refused(store, existing, tmp_path):
    assert "folder" in _refused_file(store, existing, tmp_path)
    assert "cannot be read" in _refused_file(store, existing, tmp_path / "nope.json")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.json")  # opening it would block until a writer comes
        assert "not a regular file" in _refused_file(store, existing, tmp_path / "pipe.json")


def test_import_errors_are_storage_errors():
    assert issubclass(ChatImportError, StorageError)  # the GUI's existing handler catches them
