"""A decode pass's whole layer in one compiled call (app/models/decode_block.py), on both
built-in models in their `int4_i8` run-time formats (SmolLM2: SiLU, interleaved RoPE;
Gemma 3: tanh-GELU, QK-norm, sandwich norms, sliding layers): its logits are the layers'
own operations' within float32 rounding, with the same greedy tokens; threads change no bit
(batching is held by test_decode_step.py, where both paths run it); it serves only layers
it can run; bad arguments are refused before the kernel runs."""

from __future__ import annotations

import pytest
import torch

from app.models import decode_block, decode_step, int8_products
from tests.models.test_decode_step import INT8_RUNTIME, _decode, _loaded, _prompts

pytestmark = pytest.mark.skipif(not int8_products.available(),
                                reason=f"the compiled kernels cannot run here ({int8_products.unavailable_reason()})")


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def int8_model(request, smollm2_model_path, embedded_model_path):
    loaded = _loaded(request.param, smollm2_model_path, embedded_model_path, INT8_RUNTIME)
    assert all(layer._block is not None for layer in loaded.model.layers)
    return loaded


def _without_block(loaded):
    """Undo: the layers' operations instead of the compiled layer, in both paths."""
    saved = [(layer._block, layer._decode_args) for layer in loaded.model.layers]
    for layer in loaded.model.layers:
        layer._block = None
        layer._decode_args = decode_step.prepare(layer)

    def restore():
        for layer, (block, args) in zip(loaded.model.layers, saved):
            layer._block, layer._decode_args = block, args
    return restore


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_each_layer_computes_what_its_operations_compute(int8_model, kv_dtype, monkeypatch):
    """Every layer of a few decode passes, on the same input, both ways (the Python path: the
    same operator the scripted step calls): float32 glue against torch's, within rounding."""
    from app.models.transformer import DecoderLayer

    compiled_layer = DecoderLayer._decode_block
    compared = []

    def both(self, x, rope, kv):
        out = compiled_layer(self, x, rope, kv)
        if out is None:  # a prompt's pass: the layer's operations
            return None
        block = self._block
        self.__dict__["_block"] = None  # (rewrites the same K and V: the same QKV product)
        try:
            want = DecoderLayer.forward(self, x, rope, kv)
        finally:
            self.__dict__["_block"] = block
        # Mostly a few units in the last place; where a value in the MLP sits on a rounding
        # boundary of the down product's 8-bit input, one code moves by a step (Gemma 3's
        # layer 5 once: 0.17 against a row's largest 2,210)
        scale = want.abs().amax(-1, keepdim=True)
        error = (out - want).abs()
        assert (error <= 1e-3 * scale).all() and (error.mean(-1, keepdim=True) <= 1e-5 * scale).all(), \
            (self.index, error.max())
        compared.append(self.index)
        return out

    monkeypatch.setattr(DecoderLayer, "_decode_block", both)
    monkeypatch.setattr(decode_step, "run", lambda *args, **kwargs: None)  # the layers' Python
    _decode(int8_model, _prompts(3), 3, kv_dtype)
    assert len(compared) == 3 * len(int8_model.model.layers)  # every decode pass, every layer


def test_its_greedy_tokens_are_the_layers_operations(int8_model):
    """Through the whole model the rounding differences pass through every layer's 8-bit
    activations, which turn some into larger ones (a value on a rounding boundary moves a
    code by one step of its block): measured on both built-in models, the logits of the
    two ways differ by ~0.02-0.3 on average (their spread ~2.5-3; once 0.76, a step whose
    top two were 0.04 apart), about the 8-bit activations' own noise; the greedy tokens stay the same but near a tie (where one
    differs, the replies part: compared up to there)."""
    prompts = _prompts(3)
    compiled = _decode(int8_model, prompts, 6, torch.float32)
    restore = _without_block(int8_model)
    try:
        operations = _decode(int8_model, prompts, 6, torch.float32)
    finally:
        restore()
    apart = []  # each compared step's mean difference over the logits' spread
    for key in prompts:
        for got, want in zip(compiled[key], operations[key], strict=True):
            apart.append(float((got - want).abs().mean() / want.std()))
            assert apart[-1] < 0.5, key  # one value on a boundary: Gemma 3 once 0.32
            top2 = want.topk(2).values
            if int(got.argmax()) != int(want.argmax()):
                # only near a tie; the two replies go on from different tokens, so their
                # later logits are not comparable
                assert top2[0] - top2[1] <= 1.0, key
                break
    assert sum(apart) / len(apart) < 0.1, apart


def test_threads_change_no_bit(int8_model):
    prompts = _prompts(2)
    threaded = _decode(int8_model, prompts, 3, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _decode(int8_model, prompts, 3, torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    for key in prompts:
        for got, want in zip(threaded[key][1:], alone[key][1:], strict=True):
            assert torch.equal(got, want)


def test_it_serves_only_layers_on_8_bit_activations(smollm2_model_path, embedded_model_path):
    from tests.models.test_decode_step import INT4_RUNTIME

    loaded = _loaded("smollm2", smollm2_model_path, embedded_model_path, INT4_RUNTIME)
    layer = loaded.model.layers[0]
    assert layer._block is None and not decode_block.serves(layer)
    assert layer._decode_args.ints[19] == 0 and layer._decode_args.tensors[19].numel() == 0


def test_assigning_a_weight_drops_the_compiled_layer(int8_model):
    layer = int8_model.model.layers[0]
    block, args = layer._block, layer._decode_args
    try:
        layer.attn_norm = layer.attn_norm.clone()
        assert layer._block is None and layer._decode_args is None
    finally:
        layer.__dict__["attn_norm"] = layer.attn_norm
        layer._block, layer._decode_args = block, args


def test_bad_arguments_are_refused(int8_model):
    layer = int8_model.model.layers[0]
    c = layer.cfg
    x = torch.randn(2, c.d_model)
    cos = sin = torch.zeros(2, c.head_dim)
    table = torch.zeros(2, 7, dtype=torch.int64)
    with pytest.raises(ValueError, match="constants"):
        decode_block.block(x, torch.zeros(3, dtype=torch.int64), cos, sin, table, 0, 1, 1)
    with pytest.raises(ValueError, match="x must be"):
        decode_block.block(torch.randn(2, c.d_model + 64), layer._block, cos, sin, table, 0, 1, 1)
    with pytest.raises(ValueError, match="cos and sin"):
        decode_block.block(x, layer._block, cos[:1], sin[:1], table, 0, 1, 1)
    with pytest.raises(ValueError, match="table"):
        decode_block.block(x, layer._block, cos, sin, table[:1], 0, 1, 1)
    with pytest.raises(ValueError, match="kind"):
        decode_block.block(x, layer._block, cos, sin, table, 7, 1, 1)
    with pytest.raises(ValueError, match="a table a layer"):
        decode_block.layers(x, [layer._block] * 2, [cos], [sin], [table], 0, 1, 1)
    other = layer._block.clone()
    other[decode_block.CONSTANT_FIELDS.index("F")] += 64
    with pytest.raises(ValueError, match="different shapes"):
        decode_block.layers(x, [layer._block, other], [cos] * 2, [sin] * 2, [table] * 2, 0, 1, 1)
