"""An attachment indexed for retrieval keeps its source file's sha256 (migration 3): saved,
copied into versions, exported and imported; a bad value is refused."""

from __future__ import annotations

import pytest

from app.storage import NewAttachment, StorageError, export_json, import_json

SHA = "ab" * 32


def test_the_source_hash_is_saved_exported_and_imported(store):
    chat = store.create_chat("Docs")
    message = store.add_message(chat.id, "user", "see", attachments=[
        NewAttachment("big.pdf", "pdf", "text", 9, 100, sha256=SHA),
        NewAttachment("small.txt", "text", "t", 1, 1)])
    assert [a.sha256 for a in message.attachments] == [SHA, None]
    version = store.add_version(message.id, "again", attachments=message.attachments)
    assert [a.sha256 for a in version.attachments] == [SHA, None]
    data = export_json(store, chat.id)
    copy = import_json(store, data)
    assert [a.sha256 for a in store.active_path(copy.id)[0].attachments] == [SHA, None]
    data["messages"][0]["attachments"][0]["sha256"] = "not hex"
    with pytest.raises(StorageError, match="sha256"):
        import_json(store, data)


def test_a_hash_that_is_not_text_is_refused(store):
    chat = store.create_chat("Docs")
    with pytest.raises(StorageError, match="sha256"):
        store.add_message(chat.id, "user", "x", attachments=[NewAttachment("a", "text", sha256=5)])
