"""The scripted decode step (app/models/decode_step.py) computes exactly what a layer's Python
path computes: the same logits, bit for bit, for one sequence and several together, on both
built-in models in their run-time 4-bit formats (SmolLM2: Llama layout, interleaved RoPE,
SiLU; Gemma 3: QK-norm, sandwich norms, tanh-GELU, sliding layers, two-plane products; both
on torch's 4-bit kernel and on the 8-bit activation kernel, whose decode passes also attend
in one compiled call and whose products take their pre-norms), with a bfloat16 and a float32
KV cache."""

from __future__ import annotations

import pytest
import torch

from app.engine.kv_pool import PagedBatchView, PagedKVPool
from app.models import decode_step, int8_products
from app.models.layers import WeightFormat
from app.models.loader import load_model

CPU = torch.device("cpu")
PAGE = 16
INT4_RUNTIME = WeightFormat(torch.float16, False, None, True, torch.bfloat16)  # the CPU policy's
# ... and its `int4_i8` kind: products on the 8-bit activation kernel (app/models/int8_products.py)
INT8_RUNTIME = WeightFormat(torch.float16, False, None, True, torch.bfloat16, int8_acts=True)


def _loaded(name: str, smollm2_model_path, embedded_model_path, fmt: WeightFormat):
    path = smollm2_model_path if name == "smollm2" else embedded_model_path
    loaded = load_model(path, CPU, torch.float16, torch.float32, int4=fmt)
    assert all(layer._decode_args is not None for layer in loaded.model.layers)
    return loaded


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def int4_model(request, smollm2_model_path, embedded_model_path):
    loaded = _loaded(request.param, smollm2_model_path, embedded_model_path, INT4_RUNTIME)
    assert not any(layer._fused_attention or layer._norms_in_products  # SDPA's, torch's norms
                   for layer in loaded.model.layers)
    return loaded


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def int8_model(request, smollm2_model_path, embedded_model_path):
    if not int8_products.available():
        pytest.skip(f"the 8-bit activation kernel cannot run here ({int8_products.unavailable_reason()})")
    loaded = _loaded(request.param, smollm2_model_path, embedded_model_path, INT8_RUNTIME)
    assert all(isinstance(p.codes, int8_products.Int8Codes) for layer in loaded.model.layers
               for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    # ... whose decode passes attend in one compiled call (app/models/decode_attention.py),
    # and whose norms before QKV and gate-up are computed in those products, in the scripted
    # step and the layers' Python alike
    assert all(layer._fused_attention and layer._norms_in_products for layer in loaded.model.layers)
    return loaded


@pytest.fixture
def scripted_calls(monkeypatch):
    """Counts the passes run by the scripted step (so no test passes without it)."""
    step = decode_step.compiled()
    assert step is not None, "TorchScript could not compile the decode step"
    calls = []

    def counting():
        def run(*args):
            calls.append(len(args[1]))  # the layers it ran
            return step(*args)
        return run

    monkeypatch.setattr(decode_step, "compiled", counting)
    return calls


def _decode(loaded, prompts: dict[str, list[int]], steps: int, kv_dtype: torch.dtype,
            together: bool = True) -> dict[str, list[torch.Tensor]]:
    """Prefill every prompt, then `steps` greedy decode steps: all sequences in one pass per
    step (`together`) or each alone; -> each sequence's logits after every step."""
    model = loaded.model
    pages_each = (max(map(len, prompts.values())) + steps) // PAGE + 1
    pool = PagedKVPool(model.kv_facts, 1 + pages_each * len(prompts), PAGE, CPU, kv_dtype)
    tables = {key: list(range(1 + i * pages_each, 1 + (i + 1) * pages_each)) for i, key in enumerate(prompts)}
    written = dict.fromkeys(prompts, 0)
    logits: dict[str, list[torch.Tensor]] = {key: [] for key in prompts}
    pending = dict(prompts)  # what each sequence feeds next

    def run(keys: list[str]) -> None:
        view = PagedBatchView(pool, [tables[k] for k in keys], [written[k] for k in keys],
                              [len(pending[k]) for k in keys], keys=keys)
        tokens = torch.tensor([[t for k in keys for t in pending[k]]])
        with torch.inference_mode():
            hidden = model(tokens, view.positions(), view)
            rows = model.logits(hidden[0, view.last_token_rows()])
        for key, row in zip(keys, rows):
            written[key] += len(pending[key])
            logits[key].append(row)
            pending[key] = [int(row.argmax())]

    for key in prompts:  # prompts one by one: prefill chunks take the Python path
        run([key])
    for _ in range(steps):
        if together:
            run(list(prompts))
        else:
            for key in prompts:
                run([key])
    return logits


def _prompts(n: int, length: int = 40) -> dict[str, list[int]]:
    return {f"s{i}": [1] + [(37 * j + 101 * i) % 4000 + 50 for j in range(length + 7 * i)] for i in range(n)}


def _assert_scripted_equals_python(loaded, kv_dtype, monkeypatch, scripted_calls) -> None:
    prompts = _prompts(3)
    scripted = _decode(loaded, prompts, 4, kv_dtype) | {
        f"alone-{k}": v for k, v in _decode(loaded, prompts, 2, kv_dtype, together=False).items()}
    layers = len(loaded.model.layers)
    assert scripted_calls == [layers] * (4 + 3 * 2)  # every decode step (all layers), no prefill
    monkeypatch.setattr(decode_step, "run", lambda *args, **kwargs: None)  # the layers' Python
    python = _decode(loaded, prompts, 4, kv_dtype) | {
        f"alone-{k}": v for k, v in _decode(loaded, prompts, 2, kv_dtype, together=False).items()}
    for key in python:
        for got, want in zip(scripted[key], python[key], strict=True):
            assert torch.equal(got, want), key
    # batching changes no bit either: each sequence's logits alone are those of the batch
    for key in prompts:
        for got, want in zip(python[f"alone-{key}"], python[key][:3], strict=False):
            assert torch.equal(got, want), key


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_scripted_decode_equals_the_python_path(int4_model, kv_dtype, monkeypatch, scripted_calls):
    _assert_scripted_equals_python(int4_model, kv_dtype, monkeypatch, scripted_calls)


def test_compiled_layers_on_the_8_bit_activation_kernel_equal_the_python_path(int8_model, monkeypatch):
    """Every layer one compiled call (app/models/decode_block.py), called layer after layer
    for the whole pass, without TorchScript; the layers' Python calls it a layer at a time."""
    from app.models import decode_block

    assert decode_step.mode(int8_model.model) == "compiled layers"
    calls = []
    layers = decode_block.layers
    monkeypatch.setattr(decode_block, "layers", lambda *args: calls.append(len(args[1])) or layers(*args))
    _assert_scripted_equals_python(int8_model, torch.bfloat16, monkeypatch, calls)


def test_a_sequence_past_the_sliding_window_decodes_as_in_python(int4_model, monkeypatch, scripted_calls):
    """Gemma 3's sliding layers see the last 512 positions: the slice starts past 0."""
    windows = [w for w in int4_model.model.kv_facts.windows if w is not None]
    length = (min(windows) + 40) if windows else 80
    prompts = {"long": [1] + [(13 * j) % 3000 + 60 for j in range(length)], "short": _prompts(1)["s0"]}
    scripted = _decode(int4_model, prompts, 3, torch.bfloat16)
    assert scripted_calls
    monkeypatch.setattr(decode_step, "run", lambda *args, **kwargs: None)
    python = _decode(int4_model, prompts, 3, torch.bfloat16)
    for key in python:
        assert all(torch.equal(a, b) for a, b in zip(scripted[key], python[key], strict=True))


def test_assigning_a_weight_after_loading_sends_the_layer_back_to_python(int4_model):
    layer = int4_model.model.layers[0]
    args, o = layer._decode_args, layer.o
    try:
        layer.o = o  # any assignment of a weight the step reads
        assert layer._decode_args is None
        layer.fuse_products()
        assert layer._decode_args is not None
    finally:
        layer._decode_args = args


def test_layers_outside_the_scope_keep_their_python_path(int4_model):
    """Float weights (the float32 reference path) are not scripted."""
    path = int4_model.path
    exact = load_model(path, CPU, torch.float32, torch.float32)
    assert all(layer._decode_args is None for layer in exact.model.layers)
    assert decode_step.mode(exact.model) == "Python"
    assert decode_step.mode(int4_model.model) == "TorchScript"


def test_without_torchscript_the_layers_run_in_python(int4_model, monkeypatch):
    monkeypatch.setattr(decode_step, "compiled", lambda: None)
    assert decode_step.mode(int4_model.model) == "Python (TorchScript unavailable)"
    prompts = _prompts(2)
    logits = _decode(int4_model, prompts, 2, torch.bfloat16)  # the Python path, and no error
    assert all(len(rows) == 3 for rows in logits.values())


def test_a_failed_compilation_leaves_the_python_path(monkeypatch):
    """A frozen build without the source, a torch without TorchScript: no error, no step."""
    def refuse(fn):
        raise OSError("Can't get source for decode_layers")

    monkeypatch.setattr(decode_step, "_compiled", None)
    monkeypatch.setattr(decode_step, "_compile_tried", False)
    monkeypatch.setattr(torch.jit, "script", refuse)
    assert decode_step.compiled() is None
    assert decode_step.compiled() is None  # tried once


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_attention_per_query_head_past_the_threshold_is_the_same_in_both_paths(
        int4_model, kv_dtype, monkeypatch, scripted_calls):
    """Where the CPU policy measured it faster, decode steps over at least `per_head_from`
    keys ask SDPA per query head (enable_gqa). Here 45 keys: the sequences start below it,
    at it and past it (42, 49 and 56 keys at their first step), so one crosses it mid-run.
    The scripted step and the layers' Python decide alike, together and alone."""
    from app.models import transformer

    model = int4_model.model
    per_head_calls = []
    sdpa = transformer.F.scaled_dot_product_attention

    def spying(*args, **kwargs):
        per_head_calls.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    prompts = _prompts(3)
    model.per_head_from = 45
    try:
        assert all(layer.per_head_from == 45 for layer in model.layers)
        scripted = _decode(int4_model, prompts, 4, kv_dtype) | {
            f"alone-{k}": v for k, v in _decode(int4_model, prompts, 4, kv_dtype, together=False).items()}
        assert scripted_calls
        monkeypatch.setattr(decode_step, "compiled", lambda: None)
        monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", spying)
        python = _decode(int4_model, prompts, 4, kv_dtype) | {
            f"alone-{k}": v for k, v in _decode(int4_model, prompts, 4, kv_dtype, together=False).items()}
    finally:
        model.per_head_from = None
    assert any(per_head_calls) and not all(per_head_calls)  # both layouts ran
    for key in python:
        for got, want in zip(scripted[key], python[key], strict=True):
            assert torch.equal(got, want), key
    for key in prompts:  # batched or alone: the same per sequence
        for got, want in zip(scripted[key], scripted[f"alone-{key}"], strict=True):
            assert torch.equal(got, want), key
