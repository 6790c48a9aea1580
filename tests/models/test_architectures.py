"""Every architecture against transformers in float32, from both kinds of model file.

For each case in `tests.models.tiny_models` (a tiny random-weight model made with
transformers' own config class, saved as a Hugging Face folder and written as a GGUF the way
llama.cpp's converter writes it), our loader's logits at every prompt position must be within
1e-4 of transformers' -- on a prompt longer than the sliding window where the family has one,
prefilled whole and in chunks, and through the engine (paged pool, greedy decode). Folders as
users have them are covered too: a transformers 4 config.json, sharded bfloat16 weights,
Gemma 3 with its vision tower.

The knock-out tests show that each family feature matters on that prompt: with the feature
switched off in our loaded model (or in the reference, for Llama 3's RoPE scaling), the
logits are far from transformers'. A match within 1e-4 therefore means the feature is
implemented, not merely that it is invisible on these weights.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import replace

import pytest
import torch

from app.engine.contiguous_kv import ContiguousKV
from app.engine.generate import generate
from app.engine.sampling import SamplingParams
from app.models.layers import ROPE_HALF, ROPE_INTERLEAVED
from app.models.loader import load_model
from tests.models.tiny_models import (CASES, PROMPT_LENGTH, legacy_config_json, make_gemma3_multimodal,
                                      make_tiny_model)

CPU = torch.device("cpu")
# Every case; the deep ones (the 27B models' layer counts) are marked slow.
ALL_CASES = [pytest.param(key, marks=[pytest.mark.slow] if case.deep else []) for key, case in CASES.items()]
SHALLOW_CASES = [key for key, case in CASES.items() if not case.deep]
TOLERANCE = 1e-4
FAR = 1e-2  # how far a knocked-out feature must move the logits (100x the tolerance)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """case key -> (TinyModel, transformers' logits on its prompt), each made once."""
    made = {}

    def get(key: str):
        if key not in made:
            tiny = make_tiny_model(key, tmp_path_factory.mktemp(key))
            made[key] = tiny, tiny.reference_logits()
        return made[key]

    return get


def load(tiny, source: str):
    return load_model(tiny.gguf_path if source == "gguf" else tiny.hf_dir, CPU, torch.float32)


@torch.inference_mode()
def prompt_logits(loaded, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Our float32 logits [T, V] at every position, prefilled `chunk` tokens at a time."""
    kv = ContiguousKV(loaded.kv_facts, len(ids), loaded.device, loaded.compute_dtype)
    chunk = chunk or len(ids)
    hidden = []
    while kv.length < len(ids):
        part = ids[kv.length: kv.length + chunk]
        hidden.append(loaded.model(torch.tensor([part]), kv.positions(len(part)), kv)[0])
        kv.commit(len(part))
    return loaded.model.logits(torch.cat(hidden))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---- the match ------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["gguf", "hf"])
@pytest.mark.parametrize("case", ALL_CASES)
def test_logits_match_transformers(tiny_model, case, source):
    tiny, reference = tiny_model(case)
    loaded = load(tiny, source)
    assert loaded.architecture == tiny.case.family
    assert loaded.vocab_size == reference.shape[-1]
    if tiny.case.window is not None:
        windows = [w for w in loaded.kv_facts.windows if w is not None]
        assert min(windows) == tiny.case.window < PROMPT_LENGTH
    diff = max_diff(prompt_logits(loaded, tiny.prompt_ids), reference)
    assert diff <= TOLERANCE, f"{tiny.case.key} from {source}: max |diff| {diff:.2e}"


@pytest.mark.parametrize("case", SHALLOW_CASES)
def test_chunked_prefill_across_the_window_matches_transformers(tiny_model, case):
    """Chunks of 7: keys come from the cache and the window's start moves within a chunk."""
    tiny, reference = tiny_model(case)
    loaded = load(tiny, "gguf")
    diff = max_diff(prompt_logits(loaded, tiny.prompt_ids, chunk=7), reference)
    assert diff <= TOLERANCE, f"{tiny.case.key} in chunks: max |diff| {diff:.2e}"


@pytest.mark.parametrize("case", SHALLOW_CASES)
def test_greedy_generation_on_the_engine_matches_transformers(tiny_model, case):
    """The engine's path (paged KV pool of 16-token pages, prefill in chunks of 32, then
    decode) well past the window: each chosen token is a greedy choice of transformers on the
    same text (its logit within the tolerance of the best), and the reported log-probabilities
    are transformers'. Checked against one transformers pass over prompt + reply, so a near
    tie cannot make the test flaky."""
    tiny, _ = tiny_model(case)
    loaded = load(tiny, "gguf")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, top_logprobs=5)
    result = generate(loaded, tiny.prompt_ids, params, prefill_chunk=32)
    assert len(result.completion) == params.max_tokens
    reply = result.completion_ids
    logits = tiny.reference_logits(tiny.prompt_ids + reply)[len(tiny.prompt_ids) - 1: -1]
    logprobs = torch.log_softmax(logits, dim=-1)
    for step, choice in enumerate(result.completion):
        assert logits[step].max() - logits[step, choice.id] <= TOLERANCE, f"step {step}"
        assert abs(choice.logprob - logprobs[step, choice.id].item()) <= TOLERANCE, f"step {step}"
        assert len(choice.top) == params.top_logprobs
        for token, value in choice.top:
            assert abs(value - logprobs[step, token].item()) <= TOLERANCE, f"step {step}"


@pytest.mark.parametrize("case", SHALLOW_CASES)
def test_the_gguf_and_the_folder_load_the_same_model(tiny_model, case):
    tiny, _ = tiny_model(case)
    gguf, folder = load(tiny, "gguf"), load(tiny, "hf")
    assert gguf.kv_facts == folder.kv_facts
    text = "the thing in a hat, é"
    assert gguf.tokenizer.encode(text) == folder.tokenizer.encode(text)
    # Llama's GGUF Q/K rows are permuted for interleaved RoPE; the folder's are not.
    styles = {layer.rope.style for layer in gguf.model.layers}
    assert styles == {ROPE_INTERLEAVED if tiny.case.family == "llama" else ROPE_HALF}
    assert {layer.rope.style for layer in folder.model.layers} == {ROPE_HALF}


@pytest.mark.parametrize("case", ALL_CASES)
def test_a_folder_with_a_transformers_4_config_matches_too(tiny_model, case, tmp_path):
    """Most folders on the Hub have rope_theta/rope_scaling and no layer_types; transformers
    reads the rewritten config.json as the same model (checked first), and so must we."""
    from transformers import AutoModelForCausalLM

    tiny, reference = tiny_model(case)
    folder = shutil.copytree(tiny.hf_dir, tmp_path / tiny.hf_dir.name)
    legacy_config_json(folder)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        assert max_diff(theirs(torch.tensor([tiny.prompt_ids])).logits[0], reference) <= 1e-6
    loaded = load_model(folder, CPU, torch.float32)
    assert loaded.kv_facts == load(tiny, "hf").kv_facts
    diff = max_diff(prompt_logits(loaded, tiny.prompt_ids), reference)
    assert diff <= TOLERANCE, f"{case} from a transformers 4 config.json: max |diff| {diff:.2e}"


@pytest.mark.parametrize("case", ["qwen2", "gemma2", "phi3"])
def test_a_sharded_bfloat16_folder_matches_transformers_reading_it(tiny_model, case, tmp_path):
    """Most folders hold bfloat16 weights, larger ones in several shards with an index."""
    from transformers import AutoModelForCausalLM

    tiny, _ = tiny_model(case)
    folder = tmp_path / "bf16"
    copy.deepcopy(tiny.reference).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.hf_dir / name, folder / name)
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").exists()
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        reference = theirs(torch.tensor([tiny.prompt_ids])).logits[0]
    loaded = load_model(folder, CPU, torch.float32)
    diff = max_diff(prompt_logits(loaded, tiny.prompt_ids), reference)
    assert diff <= TOLERANCE, f"{case} from sharded bfloat16: max |diff| {diff:.2e}"


def test_a_gemma3_folder_with_its_vision_tower_runs_as_the_text_model(tmp_path):
    """Gemma3ForConditionalGeneration: text_config merged, `language_model.` names mapped,
    the vision tower's tensors left alone; text logits as transformers' full model gives them."""
    tiny = make_gemma3_multimodal(tmp_path)
    loaded = load_model(tiny.hf_dir, CPU, torch.float32)
    assert loaded.architecture == "gemma3"
    assert min(w for w in loaded.kv_facts.windows if w) == tiny.case.window < PROMPT_LENGTH
    diff = max_diff(prompt_logits(loaded, tiny.prompt_ids), tiny.reference_logits())
    assert diff <= TOLERANCE, f"Gemma 3 with vision: max |diff| {diff:.2e}"


# ---- knock-outs: each feature matters on the prompt ------------------------------------------


def _drop_biases(model):
    for layer in model.layers:
        layer.q_bias = layer.k_bias = layer.v_bias = None


def _drop_qk_norm(model):
    for layer in model.layers:
        layer.q_norm = layer.k_norm = None


def _swap_gate_and_up(model):
    for layer in model.layers:
        layer.gate, layer.up = layer.up, layer.gate


def _drop_windows(model):
    for layer in model.layers:
        layer.window = None


def _drop_attention_softcap(model):
    cfg = replace(model.cfg, attn_softcap=None)
    for layer in model.layers:
        layer.cfg = cfg


def _drop_final_softcap(model):
    model.cfg = replace(model.cfg, final_softcap=None)


def _head_dim_query_scale(model):
    cfg = replace(model.cfg, query_scale=0.0)  # 0: 1 / sqrt(head_dim)
    model.cfg = cfg
    for layer in model.layers:
        layer.cfg = cfg


KNOCK_OUTS = [
    ("qwen2", "q/k/v biases", _drop_biases),
    ("qwen3", "QK-norm", _drop_qk_norm),
    ("gemma3", "QK-norm", _drop_qk_norm),
    ("phi3", "fused gate/up split gate first", _swap_gate_and_up),
    ("phi3", "sliding window", _drop_windows),
    ("gemma2", "sliding window", _drop_windows),
    ("gemma3", "sliding window", _drop_windows),
    ("gemma2", "attention soft-capping", _drop_attention_softcap),
    ("gemma2", "final soft-capping", _drop_final_softcap),
    ("gemma2-27b", "the 27B query scale", _head_dim_query_scale),
    ("gemma3-27b", "the 27B query scale", _head_dim_query_scale),
]


@pytest.mark.parametrize("source", ["gguf", "hf"])
@pytest.mark.parametrize("case,feature,knock_out", [
    pytest.param(c, f, k, id=f"{c}-{f}", marks=[pytest.mark.slow] if CASES[c].deep else [])
    for c, f, k in KNOCK_OUTS])
def test_without_the_feature_the_logits_are_far_off(tiny_model, case, feature, knock_out, source):
    tiny, reference = tiny_model(case)
    loaded = load(tiny, source)
    knock_out(loaded.model)
    diff = max_diff(prompt_logits(loaded, tiny.prompt_ids), reference)
    assert diff > FAR, f"{case} without {feature}: max |diff| only {diff:.2e}"


def test_llama3_rope_scaling_matters_and_is_read_from_both_files(tiny_model):
    """The same weights under unscaled RoPE give other logits; both files carry the scaling
    (GGUF: the converter's rope_freqs tensor, folder: rope_parameters) with the same factors."""
    tiny, reference = tiny_model("llama3-rope")
    from transformers import AutoModelForCausalLM

    config = tiny.reference.config.__class__.from_dict(tiny.reference.config.to_dict())
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    config._attn_implementation = "eager"
    unscaled = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    unscaled.load_state_dict(tiny.reference.state_dict())
    with torch.inference_mode():
        plain = unscaled(torch.tensor([tiny.prompt_ids])).logits[0]
    assert max_diff(plain, reference) > FAR

    factors = [load(tiny, source).config.rope.freq_factors for source in ("gguf", "hf")]
    assert factors[0] is not None and factors[1] is not None
    assert torch.allclose(torch.tensor(factors[0]), torch.tensor(factors[1]), rtol=1e-6)
    # All three regimes occur: kept (1), blended (between), slowed by the factor (8).
    assert 1.0 in factors[0] and 8.0 in factors[0] and any(1 < f < 8 for f in factors[0])
