"""Markdown export: a message's own Markdown cannot swallow the headings that follow it."""

from __future__ import annotations

import pytest

from app.storage import export_markdown

markdown_it = pytest.importorskip("markdown_it")

NASTY = [
    "Here is code:\n\n```python\nprint('never closed')\n\n# not a heading inside code",
    "A fence of four: ````\nwith ``` inside\n",
    "~~~\ntilde fence left open",
    "Line one\n## User\nfake role heading",
    "plain text with `inline` and ```` runs",
]


def _headings_and_code(text: str) -> tuple[list[str], list[str]]:
    tokens = markdown_it.MarkdownIt("commonmark").parse(text)
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    code = [t.content for t in tokens if t.type == "fence"]
    return headings, code


@pytest.mark.parametrize("content", NASTY)
def test_every_role_heading_survives_and_a_fenced_body_comes_back_exactly(store, content):
    chat = store.create_chat("Fences")
    store.add_message(chat.id, "user", "Show me")
    store.add_message(chat.id, "assistant", content)
    store.add_message(chat.id, "user", "Thanks")
    store.add_message(chat.id, "assistant", "You are welcome.")
    headings, code = _headings_and_code(export_markdown(store, chat.id))
    assert headings == ["Fences", "User", "Assistant", "User", "Assistant"]
    if code:  # fenced verbatim: the text round-trips
        assert code[0] == content + "\n"


def test_balanced_markdown_is_exported_as_it_is(store):
    chat = store.create_chat("Code")
    reply = "Run:\n\n```sh\nls\n```\n\n- a\n- b"
    store.add_message(chat.id, "user", "How?")
    store.add_message(chat.id, "assistant", reply)
    assert f"## Assistant\n\n{reply}\n" in export_markdown(store, chat.id)
