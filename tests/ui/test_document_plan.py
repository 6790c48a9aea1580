"""What a chat does with its documents, without Qt: when to index, which documents a
question searches, the prompt each turn becomes, passages kept with a reply, citation links."""

from __future__ import annotations

from app.retrieval.answer import INSTRUCTIONS
from app.storage import ChatStore, NewAttachment
from app.ui.citations import cite_number, link_citations
from app.ui.document_plan import (PASSAGES_KEY, cited_passages, passages_from_metadata,
                                  passages_that_fit, passages_to_metadata, prompt_messages, searched_sources,
                                  should_index)

SHA = "cd" * 32
PASSAGES = [{"number": 1, "id": 7, "document_id": 2, "file": "manual.pdf", "index": 4,
             "page": 3, "heading": "Reset", "text": "Press the red button twice.", "score": 0.03},
            {"number": 2, "id": 9, "document_id": 2, "file": "manual.pdf", "index": 8,
             "page": None, "heading": None, "text": "The lamp blinks when ready.", "score": 0.02}]


def test_a_question_gets_as_many_passages_as_the_context_has_room_for():
    assert passages_that_fit(8192, 1000, 1024) == 5
    assert passages_that_fit(2048, 0, 8) == 5
    assert passages_that_fit(1024, 0, 8) == 3
    assert passages_that_fit(1024, 2000, 8) == 1


def test_auto_indexes_only_what_does_not_fit_and_the_modes_override_it():
    assert not should_index("auto", 1000, 2000, 8192, 1024)
    assert should_index("auto", 1000, 7000, 8192, 1024)
    assert should_index("search", 0, 10, 8192, 1024)
    assert not should_index("whole", 0, 100_000, 8192, 1024)


def _chat(tmp_path):
    store = ChatStore(tmp_path)
    chat = store.create_chat("Docs")
    store.add_message(chat.id, "user", "How do I reset it?", attachments=[
        NewAttachment("manual.pdf", "pdf", "the whole manual " * 50, 900, 10, sha256=SHA),
        NewAttachment("note.txt", "text", "bring the charger", 4, 17)])
    store.add_message(chat.id, "assistant", "Press it twice [1].", metadata={PASSAGES_KEY: PASSAGES})
    store.add_message(chat.id, "user", "And then?")
    reply = store.add_message(chat.id, "assistant", "", status="streaming")
    return store, chat, reply


def test_earlier_turns_are_rebuilt_from_the_passages_saved_with_their_reply(tmp_path):
    store, chat, reply = _chat(tmp_path)
    path = store.active_path(chat.id)
    assert searched_sources(path, "auto") == [(SHA, "manual.pdf")]
    assert searched_sources(path, "whole") == []
    messages = prompt_messages("Be brief.", path, "auto", leave_out=reply.id)
    assert [m.role for m in messages] == ["system", "user", "assistant", "user"]
    first = messages[1].content
    assert "File: note.txt" in first and "bring the charger" in first  # whole
    assert "the whole manual" not in first  # searched: only its passages
    assert INSTRUCTIONS in first and "[1] (manual.pdf, page 3, “Reset”)\nPress the red button" in first
    assert first.endswith("Question: How do I reset it?")
    assert messages[3].content == "And then?"  # its passages are not retrieved yet
    whole = prompt_messages("", path, "whole", leave_out=reply.id)
    assert "the whole manual" in whole[0].content


def test_passages_round_trip_through_metadata_and_bad_entries_are_skipped():
    retrieved = passages_from_metadata({PASSAGES_KEY: PASSAGES + [{"text": "no number"}, "junk"]})
    assert [r.number for r in retrieved] == [1, 2]
    assert passages_to_metadata(retrieved) == PASSAGES
    shown = cited_passages({PASSAGES_KEY: PASSAGES})
    assert [(p.number, p.where) for p in shown] == [(1, "manual.pdf, page 3, “Reset”"), (2, "manual.pdf")]


def test_citations_become_links_outside_code_and_only_for_passages_given():
    text = "Twice [1], then wait [2] [5].\n`[1]` stays\n```\nx = a[1]\n```\n[1](http://x) too"
    linked = link_citations(text, [1, 2])
    assert "Twice [\\[1\\]](cite:1), then wait [\\[2\\]](cite:2) [5]." in linked
    assert "`[1]` stays" in linked and "x = a[1]" in linked and "[1](http://x)" in linked
    assert link_citations(text, []) == text
    assert cite_number("cite:2") == 2 and cite_number("https://example.com") is None
