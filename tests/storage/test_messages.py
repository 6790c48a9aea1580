"""Messages: the tree, versions and branches, streaming updates, threads, durability, crashes."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from app.storage import ChatStore, NewAttachment, StorageError

ROOT = Path(__file__).resolve().parents[2]


def _contents(messages):
    return [m.content for m in messages]


@pytest.fixture
def chat(store):
    return store.create_chat("Tree")


def test_add_message_follows_the_head_and_moves_it(store, chat):
    question = store.add_message(chat.id, "user", "Hi")
    reply = store.add_message(chat.id, "assistant", "Hello!")
    assert (question.parent_id, reply.parent_id) == (None, question.id)
    assert store.get_chat(chat.id).head_message_id == reply.id
    assert _contents(store.active_path(chat.id)) == ["Hi", "Hello!"]
    assert store.get_message(reply.id) == reply


def test_an_empty_chat_has_an_empty_path(store, chat):
    assert store.active_path(chat.id) == []
    assert store.chat_messages(chat.id) == []


def test_explicit_parent_and_explicit_root(store, chat):
    system = store.add_message(chat.id, "system", "Be kind.")
    store.add_message(chat.id, "user", "first")
    branch = store.add_message(chat.id, "user", "under the system message", parent_id=system.id)
    assert _contents(store.active_path(chat.id)) == ["Be kind.", "under the system message"]
    root = store.add_message(chat.id, "user", "a second root", parent_id=None)
    assert root.parent_id is None and branch.parent_id == system.id


def test_parent_must_be_in_the_same_chat(store, chat):
    other = store.create_chat("Other")
    foreign = store.add_message(other.id, "user", "elsewhere")
    with pytest.raises(StorageError, match="another chat"):
        store.add_message(chat.id, "assistant", "x", parent_id=foreign.id)
    with pytest.raises(StorageError, match="no message with id 999"):
        store.add_message(chat.id, "assistant", "x", parent_id=999)


@pytest.mark.parametrize("kwargs", [
    {"role": "bot"}, {"status": "done"}, {"content": None}, {"metadata": {"x": object()}},
    {"attachments": [NewAttachment("", "text")]}, {"attachments": ["a.txt"]},
    {"attachments": [NewAttachment("a.txt", "text", token_count=-1)]},
])
def test_bad_messages_are_refused_and_nothing_is_saved(store, chat, kwargs):
    args = {"role": "user", "content": "text", **kwargs}
    with pytest.raises(StorageError):
        store.add_message(chat.id, args.pop("role"), args.pop("content"), **args)
    assert store.chat_messages(chat.id) == []
    assert store.get_chat(chat.id).head_message_id is None


def test_attachments_are_saved_with_their_message(store, chat):
    files = [NewAttachment("notes.txt", "text", "my notes", token_count=3, size_bytes=8),
             NewAttachment("paper.pdf", "pdf", "abstract", token_count=2, size_bytes=1234)]
    message = store.add_message(chat.id, "user", "see attached", attachments=files)
    saved = store.active_path(chat.id)[0].attachments
    assert saved == message.attachments
    assert [(a.name, a.kind, a.text, a.token_count, a.size_bytes) for a in saved] == [
        ("notes.txt", "text", "my notes", 3, 8), ("paper.pdf", "pdf", "abstract", 2, 1234)]
    assert all(a.message_id == message.id for a in saved)


def test_update_message_streams_text_status_error_and_metadata(store, chat):
    store.add_message(chat.id, "user", "q")
    reply = store.add_message(chat.id, "assistant", "", status="streaming", metadata={"model": "gemma"})
    partial = store.update_message(reply.id, content="Hel")
    assert (partial.content, partial.status) == ("Hel", "streaming")
    assert partial.updated_at > reply.updated_at
    assert store.get_chat(chat.id).updated_at == partial.updated_at

    done = store.update_message(reply.id, content="Hello", status="error", error="out of memory",
                                metadata={"tokens_out": 2, "tokens_per_s": 31.5, "model": None})
    assert (done.content, done.status, done.error) == ("Hello", "error", "out of memory")
    assert done.metadata == {"tokens_out": 2, "tokens_per_s": 31.5}  # merged; None dropped "model"
    assert store.update_message(reply.id, status="complete", error="").error is None


def test_update_a_missing_message_is_a_plain_error(store):
    with pytest.raises(StorageError, match="no message with id 7"):
        store.update_message(7, content="x")


def test_regenerate_twice_gives_three_versions_and_the_head_follows(store, chat):
    question = store.add_message(chat.id, "user", "Name a colour")
    first = store.add_message(chat.id, "assistant", "red")
    second = store.add_version(first.id, "", status="streaming")
    store.update_message(second.id, content="green", status="complete")
    third = store.add_version(first.id, "blue")

    versions = store.versions(second.id)
    assert [m.id for m in versions.messages] == [first.id, second.id, third.id]
    assert (versions.index, versions.count) == (1, 3)
    assert all(m.parent_id == question.id for m in versions.messages)
    assert _contents(store.active_path(chat.id)) == ["Name a colour", "blue"]

    assert store.switch_version(first.id).head_message_id == first.id
    assert _contents(store.active_path(chat.id)) == ["Name a colour", "red"]
    store.switch_version(second.id)
    assert _contents(store.active_path(chat.id)) == ["Name a colour", "green"]
    assert store.versions(question.id).count == 1


def test_switching_a_question_version_shows_the_latest_leaf_below_it(store, chat):
    question = store.add_message(chat.id, "user", "2+2?")
    store.add_message(chat.id, "assistant", "4")
    store.add_message(chat.id, "user", "and 3+3?")
    deep_reply = store.add_message(chat.id, "assistant", "6")

    edited = store.add_version(question.id, "2+3?")  # edit and resend
    store.add_message(chat.id, "assistant", "5")
    assert _contents(store.active_path(chat.id)) == ["2+3?", "5"]
    assert store.versions(edited.id).index == 1

    chat_after = store.switch_version(question.id)
    assert chat_after.head_message_id == deep_reply.id
    assert _contents(store.active_path(chat.id)) == ["2+2?", "4", "and 3+3?", "6"]
    assert len(store.chat_messages(chat.id)) == 6


def test_a_version_keeps_the_role_and_may_carry_attachments(store, chat):
    files = (NewAttachment("a.txt", "text", "A"),)
    question = store.add_message(chat.id, "user", "read this", attachments=files)
    with pytest.raises(StorageError, match="must also be a user message"):
        store.add_version(question.id, "x", role="assistant")
    edited = store.add_version(question.id, "read this, briefly", attachments=question.attachments)
    assert [a.name for a in edited.attachments] == ["a.txt"]
    assert edited.attachments[0].id != question.attachments[0].id


def test_root_messages_have_versions_too(store, chat):
    first = store.add_message(chat.id, "user", "one")
    store.add_message(chat.id, "system", "not a version: other role", parent_id=None)
    again = store.add_version(first.id, "two")
    assert [m.id for m in store.versions(again.id).messages] == [first.id, again.id]


def test_mark_interrupted_flags_only_streaming_messages_and_keeps_text(store, chat):
    store.add_message(chat.id, "user", "q")
    streaming = store.add_message(chat.id, "assistant", "", status="streaming")
    store.update_message(streaming.id, content="half a rep")
    stopped = store.add_version(streaming.id, "stopped early", status="stopped")

    assert store.mark_interrupted() == 1
    assert store.get_message(streaming.id).status == "interrupted"
    assert store.get_message(streaming.id).content == "half a rep"
    assert store.get_message(stopped.id).status == "stopped"
    assert store.mark_interrupted() == 0


def test_a_worker_thread_streams_while_the_gui_thread_reads_and_writes(store, chat):
    store.add_message(chat.id, "user", "long story please")
    reply = store.add_message(chat.id, "assistant", "", status="streaming")
    other = store.create_chat("Meanwhile")
    errors: list[BaseException] = []

    def stream():
        try:
            for n in range(1, 301):
                store.update_message(reply.id, content="word " * n, metadata={"tokens": n})
            store.update_message(reply.id, status="complete")
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    worker = threading.Thread(target=stream)
    worker.start()
    rounds = 0
    while worker.is_alive() and rounds < 2000:
        assert {c.id for c in store.list_chats("word")} <= {chat.id}
        path = store.active_path(chat.id)
        assert path[-1].content.count("word") == path[-1].metadata.get("tokens", 0)
        store.add_message(other.id, "user", f"note {rounds}")
        rounds += 1
    worker.join(timeout=60)

    assert not errors
    final = store.get_message(reply.id)
    assert (final.content, final.status, final.metadata) == ("word " * 300, "complete", {"tokens": 300})
    assert len(store.chat_messages(other.id)) == rounds


def test_what_one_store_wrote_another_reads_without_any_commit_call(tmp_path):
    path = tmp_path / "chats.sqlite3"
    writer = ChatStore(path)
    chat = writer.create_chat("Durable")
    reply = writer.add_message(chat.id, "assistant", "", status="streaming")
    writer.update_message(reply.id, content="visible at once")

    with ChatStore(path) as reader:  # while the writer is still open (WAL: readers do not block)
        assert _contents(reader.active_path(chat.id)) == ["visible at once"]
    writer.close()
    with ChatStore(path) as reopened:
        assert reopened.get_message(reply.id).content == "visible at once"


_CRASHING_WRITER = """
import sys, time
from app.storage import ChatStore
store = ChatStore(sys.argv[1])
chat = store.create_chat("Crash")
store.add_message(chat.id, "user", "Tell me a story")
reply = store.add_message(chat.id, "assistant", "", status="streaming")
for n in range(1, 6):
    store.update_message(reply.id, content="Once upon a time " * n)
print(reply.id, flush=True)
time.sleep(120)
"""


def test_a_killed_process_keeps_its_streamed_text_and_it_is_flagged_interrupted(tmp_path):
    path = tmp_path / "chats.sqlite3"
    process = subprocess.Popen([sys.executable, "-c", _CRASHING_WRITER, str(path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.strip().isdigit(), process.stderr.read()
    finally:
        process.kill()  # SIGKILL on POSIX: no cleanup, no close, no checkpoint
        process.wait(timeout=30)
        process.stdout.close()
        process.stderr.close()
    reply_id = int(line)
    assert path.with_name(path.name + "-wal").stat().st_size > 0  # the text lives in the log

    with ChatStore(path) as store:
        assert store.get_message(reply_id).status == "streaming"
        assert store.mark_interrupted() == 1
        reply = store.get_message(reply_id)
        assert (reply.content, reply.status) == ("Once upon a time " * 5, "interrupted")
