"""A reasoning model's thinking reaches API clients as `reasoning_content`, apart from the
answer, in whole responses and streamed deltas alike (the streamed pieces add up to the
whole response); a reply without thinking has no such key."""

from __future__ import annotations

import pytest

from app.engine.events import Finished, Timings, Token, Usage
from app.server.schemas import ChatFormat


def _tokens(pieces: list[str]) -> list[Token]:
    return [Token("r", i, text) for i, text in enumerate(pieces)]


def _finished(pieces: list[str]) -> Finished:
    return Finished("r", "stop", "".join(pieces), Usage(3, 0, len(pieces)), Timings())


def _streamed(fmt: ChatFormat, pieces: list[str]) -> tuple[str, str, set[str]]:
    chunks = [fmt.token_chunk([t]) for t in _tokens(pieces)] + fmt.end_chunks("stop")
    reasoning = content = ""
    keys: set[str] = set()
    for chunk in filter(None, chunks):
        delta = chunk["choices"][0]["delta"]
        keys |= set(delta)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "") or ""
    return reasoning, content, keys


CASES = [
    # pieces of the reply, starts_in_reasoning, expected (reasoning or None, content)
    (["<thi", "nk>\nLet me ", "add.</th", "ink>\n\n", "It is ", "4."], False, ("Let me add.", "It is 4.")),
    (["Let me add.", "</think>", "It is 4."], True, ("Let me add.", "It is 4.")),  # R1: prompt opened it
    (["It is ", "4."], False, (None, "It is 4.")),
    (["<think>", "still thinking when cut"], False, ("still thinking when cut", "")),
]


@pytest.mark.parametrize("pieces, opened, expected", CASES)
def test_thinking_is_reasoning_content_whole_and_streamed(pieces, opened, expected):
    whole = ChatFormat("m", None, None, False, starts_in_reasoning=opened).response(
        _tokens(pieces), _finished(pieces))["choices"][0]["message"]
    reasoning, content = expected
    assert whole["content"] == content
    assert whole.get("reasoning_content") == reasoning
    if reasoning is None:
        assert "reasoning_content" not in whole
    got_reasoning, got_content, keys = _streamed(
        ChatFormat("m", None, None, False, starts_in_reasoning=opened), pieces)
    assert (got_reasoning, got_content) == (reasoning or "", content)
    assert ("reasoning_content" in keys) == (reasoning is not None and reasoning != "")
    assert "<think>" not in got_content and "</think>" not in got_content
