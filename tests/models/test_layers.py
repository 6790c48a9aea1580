"""The shared building blocks: RoPE layouts and scaling, soft-capping, weight formats."""

from __future__ import annotations

import math

import pytest
import torch

from app.models.layers import (ROPE_HALF, ROPE_INTERLEAVED, DualWeight, RopeSpec, WeightFormat,
                               apply_rope, linear, llama3_frequency_factors, rms_norm, soft_cap)


def _permute_for_interleaved(x: torch.Tensor) -> torch.Tensor:
    """What llama.cpp's converter does to each head of Q and K: (i, i + D/2) -> (2i, 2i + 1)."""
    D = x.shape[-1]
    return x.unflatten(-1, (2, D // 2)).transpose(-1, -2).flatten(-2)


@pytest.mark.parametrize("rotary", [16, 8])
def test_interleaved_rope_on_permuted_heads_gives_the_same_scores_as_rotate_half(rotary):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    positions = torch.arange(5)[None] * 7
    half = RopeSpec(10_000.0, rotary, ROPE_HALF)
    inter = RopeSpec(10_000.0, rotary, ROPE_INTERLEAVED)
    cos, sin = half.tables(positions, torch.float32)
    ref = apply_rope(q, cos, sin, ROPE_HALF) @ apply_rope(k, cos, sin, ROPE_HALF).transpose(-1, -2)
    if rotary != 16:
        return  # partial rotary dims are only ever rotate-half (Phi); layout equivalence is per head
    cos, sin = inter.tables(positions, torch.float32)
    qp, kp = _permute_for_interleaved(q), _permute_for_interleaved(k)
    got = apply_rope(qp, cos, sin, ROPE_INTERLEAVED) @ apply_rope(kp, cos, sin, ROPE_INTERLEAVED).transpose(-1, -2)
    assert torch.allclose(got, ref, atol=1e-5)


def test_partial_rotary_leaves_the_tail_of_each_head_untouched():
    x = torch.randn(1, 1, 3, 16)
    cos, sin = RopeSpec(10_000.0, 8).tables(torch.arange(3)[None] + 5, torch.float32)
    out = apply_rope(x, cos, sin, ROPE_HALF)
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.allclose(out[..., :8], x[..., :8])


def test_llama3_factors_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_scaling=scaling,
                         rope_theta=500_000.0, max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    factors = llama3_frequency_factors(64, 500_000.0, 8.0, 1.0, 4.0, 8192)
    got = RopeSpec(500_000.0, 64, freq_factors=factors).inverse_frequencies(torch.device("cpu"))
    assert torch.allclose(got, expected, rtol=1e-6)


def test_linear_position_scaling_divides_positions():
    spec = RopeSpec(10_000.0, 8, position_scale=4.0)
    cos, _ = spec.tables(torch.tensor([[8]]), torch.float32)
    ref, _ = RopeSpec(10_000.0, 8).tables(torch.tensor([[2]]), torch.float32)
    assert torch.allclose(cos, ref)


def test_rms_norm_and_soft_cap():
    x = torch.tensor([[3.0, 4.0]])
    out = rms_norm(x, torch.tensor([1.0, 2.0]), 0.0)
    assert torch.allclose(out, torch.tensor([[3.0, 8.0]]) / math.sqrt(12.5))
    assert soft_cap(x, None) is x
    assert torch.all(soft_cap(torch.tensor([1e6, -1e6]), 30.0).abs() <= 30.0)


def test_weight_formats_prepare_what_linear_multiplies():
    w = torch.randn(6, 4)
    x = torch.randn(1, 4)
    ref = x @ w.t()
    transposed = WeightFormat(torch.float32, transposed=True).prepare(w)
    assert transposed.shape == (4, 6) and torch.allclose(linear(x, transposed, True), ref, atol=1e-6)
    dual = WeightFormat(torch.float16, transposed=False, wide_dtype=torch.bfloat16).prepare(w)
    assert isinstance(dual, DualWeight) and dual.shape == (6, 4)
    assert torch.allclose(linear(x, dual, False), ref, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 3, 512])
def test_interleaved_rotation_is_the_same_for_few_rows_and_many(rows):
    """A decode step's few rows swap their pairs by a gather, a prefill chunk's by a flip:
    the same values as `apply_rope` either way."""
    from app.models.layers import RopeSpec, apply_rope, rotate

    spec = RopeSpec(10_000.0, 64, style="interleaved")
    x = torch.randn(1, rows, 5, 64, generator=torch.Generator().manual_seed(rows))
    positions = torch.arange(rows)[None] + 7
    cos, sin = spec.rotation(positions, torch.float32)  # [S, T, 1, R]
    got = rotate(x, cos, sin, spec.style)
    cos_t, sin_t = spec.tables(positions, torch.float32)  # [S, 1, T, R]
    want = apply_rope(x.transpose(1, 2), cos_t, sin_t, spec.style).transpose(1, 2)
    assert torch.allclose(got, want, atol=1e-6)
