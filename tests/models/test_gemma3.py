"""Gemma 3 forward pass against transformers' float32 outputs (shared reference + our fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.engine.contiguous_kv import ContiguousKV
from app.engine.generate import generate
from app.engine.sampling import SamplingParams
from app.models.loader import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp32_model(embedded_model_path):
    return load_model(embedded_model_path, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def reference(shared_dir):
    return json.loads((shared_dir / "reference" / "gemma3-270m-reference.json").read_text())


@pytest.fixture(scope="module")
def long_prompt():
    return json.loads((FIXTURES / "gemma3_long_prompt.json").read_text())


@torch.inference_mode()
def all_hidden(loaded, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Final hidden states [len(ids), d] for every prompt position, prefilled in chunks."""
    kv = ContiguousKV(loaded.config, len(ids), loaded.device, loaded.compute_dtype)
    chunk = chunk or len(ids)
    out = []
    while kv.length < len(ids):
        part = ids[kv.length: kv.length + chunk]
        hidden = loaded.model(torch.tensor([part]), kv.positions(len(part)), kv)
        kv.commit(len(part))
        out.append(hidden[0])
    return torch.cat(out)


@torch.inference_mode()
def all_logits(loaded, ids: list[int], chunk: int | None = None, at=None) -> torch.Tensor:
    """Logits [len(at), V] at positions `at` (default: every position)."""
    hidden = all_hidden(loaded, ids, chunk)
    return loaded.model.logits(hidden if at is None else hidden[at])


def assert_top10(logits: torch.Tensor, ids: list[int], values: list[float], atol: float = 1e-3):
    top_values, top_ids = torch.topk(logits, 10)
    assert top_ids.tolist() == ids
    assert torch.allclose(top_values, torch.tensor(values), atol=atol), (top_values, values)


@pytest.mark.parametrize("case", [0, 1])
def test_first_step_logits_match_transformers(fp32_model, reference, case):
    ref = reference["cases"][case]
    logits = all_logits(fp32_model, ref["prompt_ids"])[-1]
    assert_top10(logits, ref["transformers"]["top10_ids"], ref["transformers"]["top10_logits"])


@pytest.mark.parametrize("case", [0, 1])
def test_greedy_tokens_match_transformers(fp32_model, reference, case):
    ref = reference["cases"][case]
    result = generate(fp32_model, ref["prompt_ids"], GREEDY)
    assert result.completion_ids == ref["transformers"]["generated_ids"]
    assert result.text == ref["transformers"]["generated_text"]


def test_prompt_past_the_sliding_window_matches_transformers(fp32_model, long_prompt):
    ids = long_prompt["prompt_ids"]
    assert len(ids) > max(w for w in fp32_model.kv_facts.windows if w)
    positions = [int(p) for p in long_prompt["positions"]]
    logits = all_logits(fp32_model, ids, chunk=200, at=positions)
    for row, ref in zip(logits, long_prompt["positions"].values()):
        assert_top10(row, ref["top10_ids"], ref["top10_logits"])
    result = generate(fp32_model, ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                      prefill_chunk=128)
    assert result.completion_ids == long_prompt["greedy_ids"]


def test_chunk_size_does_not_change_logits_past_the_window(fp32_model, long_prompt):
    ids = long_prompt["prompt_ids"][:600]
    at = [0, 100, 511, 512, 599]
    whole = all_logits(fp32_model, ids, at=at)
    for chunk in (7, 64, 513):
        chunked = all_logits(fp32_model, ids, chunk, at=at)
        assert torch.allclose(chunked, whole, atol=1e-4, rtol=0), (chunk, (chunked - whole).abs().max())


def test_float16_weights_stay_close_to_float32(embedded_model_path, reference, fp32_model):
    from app.engine.device import compute_dtype_for

    cpu = torch.device("cpu")
    half = load_model(embedded_model_path, cpu, torch.float16, compute_dtype_for(torch.float16, cpu))
    assert half.compute_dtype == torch.float32
    for ref in reference["cases"]:
        a = all_logits(half, ref["prompt_ids"])[-1]
        b = all_logits(fp32_model, ref["prompt_ids"])[-1]
        assert torch.isfinite(a).all()
        assert int(a.argmax()) == int(b.argmax())
        assert (a - b).abs().max() < 0.5


def test_float16_with_a_bfloat16_copy_holds_both_weights(embedded_model_path, reference,
                                                        fp32_model):
    """One format the measured CPU policy (app.engine.kernel_policy) can choose."""
    from app.models.layers import DualWeight, linear

    dual = load_model(embedded_model_path, torch.device("cpu"), torch.float16, torch.float32,
                      torch.bfloat16)
    assert dual.weights_label == "float16+bfloat16"
    weight = dual.model.layers[0].up
    assert isinstance(weight, DualWeight)
    assert weight.narrow.dtype == torch.float16 and weight.wide.dtype == torch.bfloat16
    x = torch.randn(1, 640)
    # One or two rows take the float16 copy, more take the bfloat16 one.
    assert torch.equal(linear(x, weight, False), linear(x, weight.narrow, False))
    x = torch.randn(8, 640)
    assert torch.equal(linear(x, weight, False), linear(x, weight.wide, False))
    for ref in reference["cases"]:
        ids = ref["prompt_ids"]
        prefilled = all_logits(dual, ids)[-1]  # many rows: bfloat16
        decoded = all_logits(dual, ids, chunk=1)[-1]  # one row at a time: float16
        expected = all_logits(fp32_model, ids)[-1]
        for got in (prefilled, decoded):
            assert int(got.argmax()) == int(expected.argmax())
            assert (got - expected).abs().max() < 1.0
