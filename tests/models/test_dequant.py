"""The torch dequantization kernels against gguf-py's numpy reference (gguf.quants), on
synthetic blocks of every native type and on real tensors of the embedded model."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from app.models.dequant import dequantize, native_types, supported_types
from app.models.errors import ModelError
from app.models.gguf_file import GGUFFile

NATIVE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
          T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]

# Byte offsets of the float16 scale fields inside one block of each type.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0],
}
QUANTIZABLE = {T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}  # gguf.quants.quantize works


def _reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    rows = raw.reshape(-1, raw.size // max(1, int(np.prod(shape[:-1]))))
    if qtype == T.F32:
        return rows.view(np.float32).reshape(shape)
    if qtype == T.F16:
        return rows.view(np.float16).astype(np.float32).reshape(shape)
    return quants.dequantize(rows, qtype).reshape(shape)


def _check(raw: np.ndarray, qtype: T, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    """dequantize() must match gguf-py to float32 rounding (in practice: bit for bit)."""
    got = dequantize(raw, qtype, shape, dtype=dtype)
    assert got.shape == shape and got.dtype == dtype
    want = torch.from_numpy(np.ascontiguousarray(_reference(raw, qtype, shape))).to(dtype)
    np.testing.assert_allclose(got.float().numpy(), want.float().numpy(), rtol=1e-6, atol=1e-6)
    return got


def _random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes for `shape` values of `qtype`, with finite float16 scales of mixed size."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, []):
        scale = rng.uniform(-2, 2, n_blocks) * 10.0 ** rng.integers(-4, 2, n_blocks)
        scale[::7] = 0.0
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def _shapes(qtype: T) -> list[tuple[int, ...]]:
    b = GGML_QUANT_SIZES[qtype][0]
    return [(5, 3 * b), (2, 3, b), (2 * b,)]


def test_native_types_are_the_promised_ones():
    assert native_types() == set(NATIVE)
    assert set(NATIVE) <= supported_types()
    assert {T.IQ4_NL, T.TQ2_0, T.MXFP4} <= supported_types()
    assert T.Q8_K not in supported_types() and T.I32 not in supported_types()


@pytest.mark.parametrize("qtype", NATIVE, ids=lambda t: t.name)
def test_synthetic_random_blocks(qtype):
    rng = np.random.default_rng(int(qtype))
    for shape in _shapes(qtype):
        raw = _random_blocks(qtype, shape, rng)
        if qtype in (T.F16, T.BF16):  # random bits: NaN and inf included, compared as equal
            got = dequantize(raw, qtype, shape)
            np.testing.assert_array_equal(got.numpy(), _reference(raw, qtype, shape))
        elif qtype == T.F32:
            raw = rng.standard_normal(shape).astype(np.float32).view(np.uint8).reshape(-1)
            _check(raw, qtype, shape)
        else:
            _check(raw, qtype, shape)


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE | {T.F16}), ids=lambda t: t.name)
def test_synthetic_quantized_floats(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    for shape in _shapes(qtype):
        x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10, shape[:-1] + (1,)).astype(np.float32)
        if len(shape) > 1:
            x.reshape(-1, shape[-1])[0] = 0.0  # an all-zero row
        raw = np.ascontiguousarray(quants.quantize(x, qtype)).view(np.uint8).reshape(-1)
        got = _check(raw, qtype, shape)
        err = (got.numpy() - x).std() / x.std()
        assert err < 0.1  # the round trip is close to the input


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_output_dtype(qtype, dtype):
    rng = np.random.default_rng(7)
    shape = (4, GGML_QUANT_SIZES[qtype][0] * 2)
    got = _check(_random_blocks(qtype, shape, rng), qtype, shape, dtype=dtype)
    assert got.device.type == "cpu" and got.is_contiguous()


_ACCELERATORS = [d for d, ok in (("cuda", torch.cuda.is_available()),
                                  ("mps", torch.backends.mps.is_available())) if ok]


@pytest.mark.skipif(not _ACCELERATORS, reason="no CUDA or MPS device")
@pytest.mark.parametrize("qtype", NATIVE, ids=lambda t: t.name)
def test_accelerator_matches_cpu(qtype):
    rng = np.random.default_rng(11)
    shape = (64, GGML_QUANT_SIZES[qtype][0] * 4)
    raw = _random_blocks(qtype, shape, rng)
    cpu = dequantize(raw, qtype, shape)
    for device in _ACCELERATORS:
        for dtype in (torch.float32, torch.float16):
            got = dequantize(raw, qtype, shape, device=device, dtype=dtype)
            assert got.device.type == device and got.dtype == dtype and got.shape == shape
            torch.testing.assert_close(got.cpu(), cpu.to(dtype), rtol=1e-6, atol=1e-6, equal_nan=True)


def test_large_tensor_spans_several_chunks():
    rng = np.random.default_rng(8)
    shape = (1100, 512)  # 563k values: more than one chunk of blocks
    _check(_random_blocks(T.Q4_K, shape, rng), T.Q4_K, shape)
    _check(_random_blocks(T.Q8_0, shape, rng), T.Q8_0, shape)


def test_read_only_and_misaligned_input():
    rng = np.random.default_rng(9)
    shape = (3, 256)
    raw = _random_blocks(T.Q5_K, shape, rng)
    read_only = raw.copy()
    read_only.flags.writeable = False
    misaligned = np.empty(raw.size + 1, np.uint8)[1:]
    misaligned[:] = raw
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable tensor" warning either
        for variant in (read_only, misaligned, raw.reshape(3, -1)):
            _check(variant, T.Q5_K, shape)
    assert misaligned.tolist() == raw.tolist()  # the input is never modified


def test_empty_tensor():
    assert dequantize(np.zeros(0, np.uint8), T.Q4_K, (0, 256)).shape == (0, 256)
    assert dequantize(np.zeros(0, np.uint8), T.IQ4_NL, (0, 32)).shape == (0, 32)


# ---- real tensors of the embedded model -----------------------------------------------------


@pytest.fixture(scope="module")
def embedded(embedded_model_path):
    with GGUFFile(embedded_model_path) as f:
        yield f


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_embedded_model_tensors(embedded, qtype):
    names = [n for n, info in embedded.tensors.items() if info.ggml_type == qtype and n != "token_embd.weight"]
    assert names, f"the embedded model has no {qtype.name} tensor"
    for name in {names[0], names[len(names) // 2], names[-1]}:
        info = embedded.tensors[name]
        _check(embedded.raw_tensor(name), qtype, info.shape)


def test_embedded_token_embedding_rows(embedded):
    info = embedded.tensors["token_embd.weight"]
    rows, cols = 3000, info.shape[1]
    row_bytes = info.nbytes // info.shape[0]
    raw = embedded.raw_tensor("token_embd.weight")
    _check(raw[:rows * row_bytes], info.ggml_type, (rows, cols))
    _check(raw[-rows * row_bytes:], info.ggml_type, (rows, cols))


# ---- fallback and errors --------------------------------------------------------------------


def test_fallback_to_gguf_py():
    rng = np.random.default_rng(10)
    raw = _random_blocks(T.IQ4_NL, (4, 64), rng)
    got = _check(raw, T.IQ4_NL, (4, 64))
    assert got.is_contiguous()
    x = rng.standard_normal((3, 256)).astype(np.float32)
    raw = np.ascontiguousarray(quants.quantize(x, T.TQ2_0)).reshape(-1)
    _check(raw, T.TQ2_0, (3, 256))
    _check(raw, T.TQ2_0, (3, 256), dtype=torch.float16)


@pytest.mark.parametrize("qtype", [T.Q8_K, T.Q8_1, T.I32, T.F64], ids=lambda t: t.name)
def test_unsupported_type(qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros(4 * type_size, np.uint8)
    with pytest.raises(ModelError, match=f"Tensor type {qtype.name} is not supported"):
        dequantize(raw, qtype, (4 * block_size,))


def test_unknown_type_id():
    with pytest.raises(ModelError, match="Unknown tensor type 1234"):
        dequantize(np.zeros(32, np.uint8), 1234, (8,))


def test_size_mismatches():
    with pytest.raises(ModelError, match="needs 68 bytes but 67 were given"):
        dequantize(np.zeros(67, np.uint8), T.Q8_0, (2, 32))
    with pytest.raises(ModelError, match="rows of 48 values do not fit Q8_0 blocks of 32"):
        dequantize(np.zeros(51, np.uint8), T.Q8_0, (48,))
    with pytest.raises(ModelError, match="needs 16 bytes"):
        dequantize(np.zeros(12, np.uint8), T.F32, (2, 2))
