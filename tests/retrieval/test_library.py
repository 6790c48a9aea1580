"""Indexing once, resuming, re-indexing a changed file, and retrieving the right passage."""

from __future__ import annotations

import threading

import pytest

from app.retrieval.answer import cited_numbers, question_prompt
from app.retrieval.index import IndexCancelled
from app.retrieval.library import DocumentLibrary

TOPICS = {
    "Lighthouse": "The lighthouse keeper lights the lamp at dusk and logs every passing ship.",
    "Bread": "To bake bread, knead the dough for ten minutes and let it rise for two hours.",
    "Volcanoes": "Volcanoes erupt when magma from the mantle reaches the surface through vents.",
    "Chess": "In chess, the knight moves in an L shape and can jump over other pieces.",
    "Tax": "The annual tax return is due on the thirtieth of April for most residents.",
}


def write_doc(path, topics=TOPICS, filler=40):
    sections = []
    for title, fact in topics.items():
        padding = " ".join(f"Background sentence {i} about {title.lower()}." for i in range(filler))
        sections.append(f"# {title}\n{padding}\n\n{fact}")
    path.write_text("\n\n".join(sections))
    return path


@pytest.fixture
def library(tmp_path, encoder):
    lib = DocumentLibrary(tmp_path / "index.sqlite3", tmp_path / "models", lambda: encoder)
    yield lib
    lib.close()


def test_the_passage_that_answers_is_retrieved_with_its_heading(library, tmp_path):
    doc = library.index_file(write_doc(tmp_path / "notes.md"))
    found = library.retrieve("When is the tax return due?", [doc], k=3)
    assert "thirtieth of April" in found[0].passage.passage.text
    assert found[0].passage.passage.heading == "Tax" and found[0].passage.document_name == "notes.md"
    found = library.retrieve("How does a knight move?", [doc], k=3)
    assert any("L shape" in r.passage.passage.text for r in found)
    prompt = question_prompt("How does a knight move?", found)
    assert "[1] (notes.md" in prompt and "L shape" in prompt and prompt.endswith("How does a knight move?")
    assert cited_numbers("It jumps [1], in an L [2][1] and [9].", found) == [1, 2]


def test_the_index_survives_a_restart_and_is_reused(tmp_path, encoder):
    path = write_doc(tmp_path / "notes.md")
    first = DocumentLibrary(tmp_path / "index.sqlite3", tmp_path / "models", lambda: encoder)
    doc = first.index_file(path)
    first.close()
    calls = []

    def counting_encoder():
        calls.append(1)
        return encoder

    second = DocumentLibrary(tmp_path / "index.sqlite3", tmp_path / "models", counting_encoder)
    assert second.index_file(path) == doc  # nothing to embed: the encoder is not even loaded
    assert calls == []
    assert "magma" in second.retrieve("What makes a volcano erupt?", [doc])[0].passage.passage.text
    second.close()


def test_cancel_keeps_what_was_done_and_resume_finishes(library, tmp_path):
    library.embed_batch = 4
    path = write_doc(tmp_path / "notes.md", filler=60)
    cancel = threading.Event()
    seen = []

    def progress(done, total):
        seen.append((done, total))
        cancel.set()  # stop after the first batch

    with pytest.raises(IndexCancelled):
        library.index_file(path, cancel=cancel, progress=progress)
    done, total = seen[0]
    assert 0 < done < total
    resumed = []
    doc = library.index_file(path, progress=lambda d, t: resumed.append(d))
    assert resumed[0] > done and resumed[-1] == total  # it continued, it did not restart
    assert library.index.missing_vectors(doc) == []


def test_a_changed_file_is_indexed_again(library, tmp_path):
    path = write_doc(tmp_path / "notes.md")
    old = library.index_file(path)
    write_doc(path, {**TOPICS, "Tax": "The tax return is now due on the first of June."})
    new = library.index_file(path)
    assert new != old
    assert "first of June" in library.retrieve("When is the tax return due?", [new])[0].passage.passage.text


def test_a_source_files_comments_are_not_taken_for_its_sections(library, tmp_path):
    path = tmp_path / "tool.py"
    path.write_text(write_doc(tmp_path / "notes.md").read_text().replace("# ", "# Note: "))
    found = library.retrieve("When is the tax return due?", [library.index_file(path)], k=3)
    assert "thirtieth of April" in found[0].passage.passage.text
    assert all(r.passage.passage.heading is None for r in found)
