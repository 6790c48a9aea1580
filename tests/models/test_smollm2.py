"""The default built-in model, SmolLM2 135M Instruct (llama architecture, byte-level BPE, ChatML),
against transformers float32 (tests/fixtures/smollm2_reference.json, made by
scripts/make_smollm2_fixture.py): the chat prompt's token ids, first-step logits, greedy tokens
and each step's top-5 logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.engine.generate import generate
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message, encode_chat
from app.models.loader import load_model
from tests.models.test_gemma3 import all_logits, assert_top10

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "smollm2_reference.json").read_text())


@pytest.fixture(scope="module")
def fp32_model(smollm2_model_path):
    return load_model(smollm2_model_path, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["question"][:20])
def test_the_chat_prompt_tokenizes_as_transformers_does(fp32_model, case):
    ids = encode_chat(fp32_model.tokenizer, fp32_model.template, [Message("user", case["question"])])
    assert ids == case["prompt_ids"]


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["question"][:20])
def test_first_step_logits_match_transformers(fp32_model, case):
    logits = all_logits(fp32_model, case["prompt_ids"])[-1]
    assert_top10(logits, case["top10_ids"], case["top10_logits"], atol=2e-3)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["question"][:20])
def test_greedy_tokens_and_logprobs_match_transformers(fp32_model, case):
    steps = len(case["greedy_ids"])
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, top_logprobs=5)
    result = generate(fp32_model, case["prompt_ids"], params)
    assert result.completion_ids == case["greedy_ids"]
    assert len(case["steps"]) == steps
    for got, want in zip(result.completion, case["steps"]):
        assert [t for t, _ in got.top] == want["top5_ids"]
        assert [lp for _, lp in got.top] == pytest.approx(want["top5_logprobs"], abs=2e-3)


def test_the_capital_of_france_is_paris(fp32_model):
    case = FIXTURE["cases"][0]
    result = generate(fp32_model, case["prompt_ids"], SamplingParams(max_tokens=16, temperature=0))
    assert "Paris" in result.text
