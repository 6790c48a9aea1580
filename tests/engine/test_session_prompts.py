"""How the chat window's session writes a conversation for the model: in the model's own
chat format, or, for a built-in base model, as one text it continues."""

from __future__ import annotations

import queue

import pytest

from app.engine.events import Failed, Finished
from app.engine.sampling import SamplingParams
from app.engine.session import ModelSession
from app.models.chat_template import Message

TEXT = "The three primary colours are"


def _greedy_text(session: ModelSession, ids: list[int]) -> str:
    events: queue.SimpleQueue = queue.SimpleQueue()
    session.submit(ids, SamplingParams(max_tokens=6, temperature=0), events.put)
    while True:
        event = events.get(timeout=120)
        assert not isinstance(event, Failed), event
        if isinstance(event, Finished):
            return event.text


@pytest.mark.slow
def test_a_built_in_base_model_continues_the_text(embedded_model_path):
    session = ModelSession()
    try:
        session.load(embedded_model_path, "cpu", "auto", tune=False)
        tok = session._loaded.tokenizer
        messages = [Message("user", TEXT)]
        assert session.chat_prompt(messages) == [tok.bos_id] + tok.encode(TEXT)
        # a second turn goes on from the whole text; a system prompt leads it
        turns = [Message("system", "Colours."), Message("user", TEXT),
                 Message("assistant", " red, yellow and blue."), Message("user", " Mixed,")]
        expected = "Colours.\n\n" + TEXT + " red, yellow and blue. Mixed,"
        assert session.chat_prompt(turns) == [tok.bos_id] + tok.encode(expected)
        assert session.continuation_prompt(messages, " red") == [tok.bos_id] + tok.encode(TEXT) + tok.encode(" red")
        assert "red" in _greedy_text(session, session.chat_prompt(messages))
    finally:
        session.close()


@pytest.mark.slow
def test_a_chat_model_gets_its_chat_format(smollm2_model_path):
    session = ModelSession()
    try:
        session.load(smollm2_model_path, "cpu", "auto", tune=False)
        ids = session.chat_prompt([Message("user", TEXT)])
        text = session._loaded.tokenizer.decode(ids, skip_special=False)
        assert "<|im_start|>user\n" + TEXT in text and text.endswith("<|im_start|>assistant\n")
    finally:
        session.close()
