"""Q/K/V and gate/up joined into one product each at load (`layers.fuse`): the joined
product is the parts' products side by side, the parts become views of it, and a weight
cache's views are joined again without a copy."""

from __future__ import annotations

import pytest
import torch

from app.models.layers import DualWeight, fuse, linear
from app.models.quantized import (Int4Form, QuantizedWeight, int4_kernel_available, pack_int4,
                                  quantize_int4)

ROWS = (128, 64, 64)  # 4-bit parts must be whole 64-row tiles
IN = 96


def _floats(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, IN, generator=g) for n in ROWS]


def _same_memory(part: torch.Tensor, whole: torch.Tensor) -> bool:
    return part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


@pytest.mark.parametrize("transposed", [False, True])
def test_joined_float_product_is_the_parts_side_by_side(transposed):
    ws = [w.t().contiguous() if transposed else w for w in _floats(0)]
    joined, parts = fuse(ws, transposed)
    x = torch.randn(3, IN)
    expected = torch.cat([linear(x, w, transposed) for w in ws], dim=-1)
    assert torch.allclose(linear(x, joined, transposed), expected, atol=1e-5)
    for part, w in zip(parts, ws):
        assert torch.equal(part, w) and _same_memory(part, joined)
    again, _ = fuse(parts, transposed)  # what a weight cache restores: views side by side
    assert again.data_ptr() == joined.data_ptr() and torch.equal(again, joined)


def test_joined_dual_weight_keeps_both_copies():
    ws = [DualWeight(w.half(), w.bfloat16()) for w in _floats(1)]
    joined, parts = fuse(ws, False)
    assert isinstance(joined, DualWeight) and joined.shape == (sum(ROWS), IN)
    for rows in (1, 8):  # the narrow copy, then the wide one
        x = torch.randn(rows, IN)
        expected = torch.cat([linear(x, w, False) for w in ws], dim=-1)
        assert torch.equal(linear(x, joined, False), expected)
    assert all(_same_memory(p.narrow, joined.narrow) for p in parts)


def _two_planes(w: torch.Tensor) -> Int4Form:
    """A 4-bit form of w with a second plane (as Q5/Q8 blocks have)."""
    form = quantize_int4(w)
    h = torch.randint(-8, 8, w.shape, generator=torch.Generator().manual_seed(w.shape[0]),
                      dtype=torch.int8)
    return Int4Form(form.lo, h, form.s, form.b)


@pytest.mark.skipif(not int4_kernel_available(), reason="no 4-bit kernel in this torch")
@pytest.mark.parametrize("form", [quantize_int4, _two_planes], ids=["one plane", "two planes"])
def test_joined_4bit_planes_multiply_like_the_parts(form):
    ws = [QuantizedWeight(pack_int4(form(w), torch.bfloat16), w.shape[0], IN,
                          torch.bfloat16) for w in _floats(2)]
    joined, parts = fuse(ws, False)
    assert joined.codes.planes == ws[0].codes.planes
    x = torch.randn(1, IN)
    expected = torch.cat([linear(x, w, False) for w in ws], dim=-1)
    assert torch.equal(linear(x, joined, False), expected)
    for part, w in zip(parts, ws):  # a part alone: its scales, a slice of the joined ones
        assert torch.equal(linear(x, part, False), linear(x, w, False))
        assert _same_memory(part.codes.scale_zeros, joined.codes.scale_zeros)
        assert torch.equal(part.codes.scale_zeros, w.codes.scale_zeros)
    again, _ = fuse(parts, False)  # what a weight cache restores: nothing is copied
    assert again.codes.packed.data_ptr() == joined.codes.packed.data_ptr()
    assert again.codes.scale_zeros.data_ptr() == joined.codes.scale_zeros.data_ptr()
    assert torch.equal(linear(x, again, False), expected)


def test_weights_of_different_kinds_stay_apart():
    a, b, c = _floats(3)
    assert fuse([a, b.half(), c], False) is None
    assert fuse([a, DualWeight(b.half(), b.bfloat16())], False) is None



def _qk_norm_lm():
    from app.models.layers import RopeSpec, WeightFormat
    from app.models.transformer import DecoderConfig, TransformerLM

    cfg = DecoderConfig(architecture="qwen3", vocab_size=50, d_model=32, n_layers=1, n_heads=4,
                        n_kv_heads=2, head_dim=16, ffn_dim=64, context_length=64, rms_eps=1e-6,
                        rope=RopeSpec(10_000.0, 16), qk_norm=True)
    return TransformerLM(cfg, WeightFormat(torch.float32, transposed=False), torch.float32)


def _loaded(weights: dict[str, torch.Tensor]):
    model = _qk_norm_lm()
    for slot, value in weights.items():
        model.assign(slot, value)
    return model.finish_loading()


def _run(model) -> torch.Tensor:
    from app.engine.contiguous_kv import ContiguousKV

    kv = ContiguousKV(model.kv_facts, 16, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([[3, 7, 11, 5]]), kv.positions(4), kv)


def test_qk_norm_runs_as_one_norm_and_a_later_weight_still_wins():
    """Q and K heads normed together with one [H + Hkv, D] weight give the two norms' values
    exactly; a q_norm assigned after loading is used, not the joined weight made before."""
    g = torch.Generator().manual_seed(1)
    weights = {slot: (1 + 0.2 * torch.rand(*shape, generator=g)) if len(shape) == 1
               else 0.1 * torch.randn(*shape, generator=g)
               for slot, shape in _qk_norm_lm().slot_shapes().items()}
    model = _loaded(weights)
    layer = model.layers[0]
    assert layer.qk_norm is not None and layer.qk_norm.shape == (4 + 2, 16)
    joined = _run(model)
    layer._qk_norm_of = ()  # the two separate norms
    assert torch.equal(_run(model), joined)

    other = 1 + 0.3 * torch.rand(16, generator=g)
    model = _loaded(weights)
    model.assign("layers.0.q_norm", other)  # after finish_loading
    expected = _loaded(weights | {"layers.0.q_norm": other})
    assert torch.equal(_run(model), _run(expected))
    assert not torch.equal(_run(model), joined)
