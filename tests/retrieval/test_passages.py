"""Splitting keeps each passage's place and stays within the encoder's budget."""

from __future__ import annotations

from app.retrieval.passages import split_passages


def words(text: str) -> int:
    return len(text.split())


def test_headings_and_pages_are_kept():
    text = ("# Setup\nInstall it.\n\n## Running\nRun it daily.\n\n"
            "--- Page 2 ---\nThe second page talks about cleaning.\n\n--- Page 3 ---\nThe end.")
    passages = split_passages(text, words, target_tokens=50, overlap_tokens=10)
    by_text = {p.text.split("\n")[-1]: p for p in passages}
    assert by_text["Install it."].heading == "Setup" and by_text["Install it."].page is None
    assert by_text["Run it daily."].heading == "Running"
    assert by_text["The second page talks about cleaning."].page == 2
    assert by_text["The end."].page == 3
    assert [p.index for p in passages] == list(range(len(passages)))


def test_long_sections_are_cut_with_overlap_and_within_budget():
    body = " ".join(f"Sentence number {i} is here." for i in range(200))
    passages = split_passages("# Long\n" + body, words, target_tokens=100, overlap_tokens=20)
    assert len(passages) > 5
    for p in passages:
        assert words(p.text) <= 100 + 2  # the heading line rides along in the first
    for a, b in zip(passages, passages[1:]):
        tail = " ".join(a.text.split()[-5:])
        assert tail in b.text  # the next passage starts with the end of this one
    joined = " ".join(p.text for p in passages)
    assert all(f"number {i} " in joined for i in range(200))


def test_no_passage_is_only_a_heading_or_a_repeated_tail():
    text = "# A\n" + " ".join(f"w{i}" for i in range(100)) + "\n\n# B\nshort text here"
    passages = split_passages(text, words, target_tokens=101, overlap_tokens=20)
    assert passages[-1].heading == "B" and "short text here" in passages[-1].text
    assert len({p.text for p in passages}) == len(passages)
    assert split_passages("# Only a heading", words) == []


def test_a_hash_line_in_a_code_fence_or_in_source_code_is_not_a_heading():
    text = ("# Guide\n\nInstall the tool first.\n\n```sh\n# install it\npip install tool\n```\n\n"
            "Then run it.")
    passages = split_passages(text, words)
    assert {p.heading for p in passages} == {"Guide"}
    assert "# install it" in passages[0].text and "Then run it." in passages[-1].text
    source = "import os\n\n# Weights are joined here.\nx = 1\n\n# Another comment\ny = 2"
    code = split_passages(source, words, headings=False)
    assert [p.heading for p in code] == [None] and "# Another comment" in code[0].text
    # As prose, the same lines would be headings (what a Markdown document means by them).
    assert {p.heading for p in split_passages(source, words)} == {None, "Weights are joined here.",
                                                                  "Another comment"}
