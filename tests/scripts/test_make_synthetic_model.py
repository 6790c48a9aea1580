"""scripts/make_synthetic_model.py: a Llama-shaped GGUF of random 4-bit weights that the app
loads and runs like any model file, with the tokenizer it was given."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_synthetic_model.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_synthetic_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_q4_1_blocks_hold_their_spread():
    from gguf.constants import GGMLQuantizationType

    from app.models.dequant import dequantize

    blocks = _script().q4_1_rows(np.random.default_rng(1), 8, 256, spread=0.5)
    assert blocks.shape == (8, 256 // 32 * 20) and blocks.dtype == np.uint8
    values = dequantize(blocks, GGMLQuantizationType.Q4_1, (8, 256))
    assert -0.25 <= float(values.min()) < -0.2 and 0.2 < float(values.max()) <= 0.25
    assert abs(float(values.mean())) < 0.02


def test_a_synthetic_model_loads_and_decodes_with_the_tokenizer_it_copies(smollm2_model_path, tmp_path):
    from app.engine.device import load_on
    from app.engine.generate import generate
    from app.engine.sampling import SamplingParams

    shape = (128, 2, 256, 2, 1)  # d_model, layers, MLP width, query heads, KV heads
    path = _script().make_synthetic_model(smollm2_model_path, tmp_path / "synthetic.gguf", shape)
    loaded = load_on(path, "cpu", "auto", measure=False)
    cfg = loaded.model.cfg
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (128, 2, 2, 1, 64)
    reference = load_on(smollm2_model_path, "cpu", "auto", measure=False).tokenizer
    text = "The weights are random; the tokenizer is SmolLM2's."
    assert loaded.tokenizer.encode(text) == reference.encode(text)
    result = generate(loaded, loaded.tokenizer.encode(text),
                      SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=1))
    assert len(result.completion) == 6
    # The layers carry signal: the greedy token stands out of 49,152 (a uniform one: -10.8).
    assert all(c.logprob > -6 for c in result.completion)
