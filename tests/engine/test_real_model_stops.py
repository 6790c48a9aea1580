"""Stop strings and stop tokens on the real model (greedy text known from the reference)."""

from __future__ import annotations

import pytest

from app.engine.device import load_on
from app.engine.generate import generate
from app.engine.sampling import SamplingParams

CAPITAL = [2, 818, 5279, 529, 7001, 563]  # "The capital of France is"
# greedy continuation: " the capital of the country of France. It is the largest city ..."


@pytest.fixture(scope="module")
def model(embedded_model_path):
    return load_on(embedded_model_path, "cpu", "float32")


def test_stop_string_across_token_boundaries_is_cut_and_never_shown(model):
    shown = []
    result = generate(model, CAPITAL, SamplingParams(max_tokens=32, temperature=0,
                                                     stop=("country of",)), on_text=shown.append)
    assert result.finish_reason == "stop"
    assert result.text == " the capital of the "
    assert "".join(shown) == result.text
    assert not any("country" in piece for piece in shown)


def test_stop_string_that_never_completes_is_released(model):
    result = generate(model, CAPITAL, SamplingParams(max_tokens=8, temperature=0,
                                                     stop=("capital city",)))
    assert result.finish_reason == "length"
    assert result.text == " the capital of the country of France."


def test_stop_token_ids_end_the_reply(model):
    result = generate(model, CAPITAL, SamplingParams(max_tokens=32, temperature=0,
                                                     stop_token_ids=(236761,)))  # "."
    assert result.finish_reason == "stop"
    assert result.text == " the capital of the country of France"
    assert result.completion_ids[-1] == 236761
