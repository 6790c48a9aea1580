"""Dequantize GGUF tensor bytes to a torch tensor, in vectorized torch.

`dequantize(raw, ggml_type, shape)` turns the stored bytes of one tensor (a uint8 numpy array,
e.g. `GGUFFile.raw_tensor(name)`) into a float tensor of `shape` (torch order). The kernels
are plain torch ops on uint8/int16/int32/float32 tensors -- no float64, no complex, no
exotic ops -- so they run multi-threaded on CPU and unchanged on CUDA or MPS once the raw
bytes have been moved there. They follow ggml's block layouts (ggml-quants.c, gguf-py's
gguf/quants.py) and perform the same float32 operations in the same order, so the results
match gguf-py's numpy reference bit for bit.

Every kernel takes `blocks`, a uint8 tensor of shape (n_blocks, type_size), and returns
float32 of shape (n_blocks, block_size). Types without a torch kernel but known to gguf-py
(the IQ*, TQ*, MXFP4, ... families) fall back to `gguf.quants.dequantize` in numpy; any
other type raises `ModelError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from app.models.errors import ModelError
from app.models.tensor_formats import NATIVE_TYPES, readable_types

T = GGMLQuantizationType
Kernel = Callable[[torch.Tensor], torch.Tensor]

# Blocks are dequantized this many elements at a time: it bounds the temporaries of the
# bit unpacking (a few times the chunk) and keeps them in cache on CPU.
_CPU_CHUNK_ELEMENTS = 1 << 18
_DEVICE_CHUNK_ELEMENTS = 1 << 24


# ---- helpers -------------------------------------------------------------------------------


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 little-endian float16 fields -> (..., 1) float32."""
    return b.contiguous().view(torch.int16).view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 2, k): low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 4, k) 2-bit fields, bits 0-1 first, then 2-3, 4-5, 6-7."""
    return torch.stack((qs & 3, (qs >> 2) & 3, (qs >> 4) & 3, qs >> 6), dim=1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 8, k): bit 0 of every byte first, then bit 1, ... bit 7."""
    return torch.stack([(qh >> i) & 1 for i in range(8)], dim=1)


def _bits_little(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) uint8 (a little-endian u32) -> (n, 32): bit j of the u32 at position j."""
    return _bits(qh).transpose(1, 2).reshape(qh.shape[0], -1)


# ---- float types ---------------------------------------------------------------------------


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    # (n, 4) bytes -> (n, 1) float32
    return blocks.contiguous().view(torch.int32).view(torch.float32)


def _f16_kernel(blocks: torch.Tensor) -> torch.Tensor:
    # (n, 2) bytes -> (n, 1)
    return _f16(blocks)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # (n, 2) bytes: the top half of a float32 -> (n, 1)
    hi = blocks.contiguous().view(torch.int16).to(torch.int32)
    return (hi << 16).view(torch.float32)


# ---- 32-element blocks ---------------------------------------------------------------------
# The codes' float32 copy is scaled in place: one buffer, one pass fewer (the same values: a
# screened head dequantizes ~1,024 rows a token, 175 -> ~100 us on Gemma 3's).


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # 18 bytes: d f16 | qs[16]; x[j] = qs[j] & 0xF, x[j+16] = qs[j] >> 4; y = d * (x - 8)
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:18]).reshape(-1, 32).to(torch.int8) - 8
    return q.to(torch.float32).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # 20 bytes: d f16 | m f16 | qs[16] (nibbles as Q4_0); y = d * x + m
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:20]).reshape(-1, 32)
    return q.to(torch.float32).mul_(d).add_(m)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # 22 bytes: d f16 | qh u32 | qs[16]; x[j] = nibble j | (bit j of qh) << 4; y = d * (x - 16)
    d = _f16(blocks[:, 0:2])
    qh = _bits_little(blocks[:, 2:6])
    ql = _nibbles(blocks[:, 6:22]).reshape(-1, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return q.to(torch.float32).mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # 24 bytes: d f16 | m f16 | qh u32 | qs[16] (as Q5_0); y = d * x + m
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    qh = _bits_little(blocks[:, 4:8])
    ql = _nibbles(blocks[:, 8:24]).reshape(-1, 32)
    q = ql | (qh << 4)
    return q.to(torch.float32).mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # 34 bytes: d f16 | qs int8[32]; y = qs * d
    d = _f16(blocks[:, 0:2])
    return blocks[:, 2:34].view(torch.int8).to(torch.float32).mul_(d)


# ---- 256-element super-blocks (k-quants) ---------------------------------------------------


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # 84 bytes: scales[16] | qs[64] | d f16 | dmin f16
    # 16 groups of 16; scales[g] = sc (low nibble) | m (high nibble); y = d*sc * x - dmin*m
    # qs: two halves of 32 bytes, each holding 4 x 32 2-bit values (bits 0-1 first)
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d = _f16(blocks[:, 80:82])
    dmin = _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _crumbs(blocks[:, 16:80].reshape(n * 2, 32)).reshape(n, 16, 16)
    return q.to(torch.float32).mul_(dl).sub_(ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # 110 bytes: hmask[32] | qs[64] | scales[12] | d f16
    # 16 groups of 16 with signed 6-bit scales: low 4 bits from scales[0:8] (low nibbles for
    # groups 0-7, high nibbles for 8-15), high 2 bits from scales[8:12] (bits 0-1 for groups
    # 0-3, 2-3 for 4-7, ...). x = 2 bits of qs (as Q2_K) minus 4 where the hmask bit is 0.
    # y = d * (scale - 32) * x
    n = blocks.shape[0]
    d = _f16(blocks[:, 108:110])
    lo = _nibbles(blocks[:, 96:104]).reshape(n, 16)
    hi = _crumbs(blocks[:, 104:108]).reshape(n, 16)
    scale = (lo | (hi << 4)).to(torch.int8) - 32
    dl = (d * scale.to(torch.float32)).reshape(n, 16, 1)
    ql = _crumbs(blocks[:, 32:96].reshape(n * 2, 32)).reshape(n, 16, 16).to(torch.int8)
    qh = _bits(blocks[:, 0:32]).reshape(n, 16, 16).to(torch.int8)
    q = ql - ((qh ^ 1) << 2)
    return q.to(torch.float32).mul_(dl).reshape(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, each (n, 8) float32.

    bytes 0-3: scales 0-3 (bits 0-5), top bits of scales 4-7 (bits 6-7)
    bytes 4-7: mins 0-3 (bits 0-5), top bits of mins 4-7 (bits 6-7)
    bytes 8-11: low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)
    """
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K header: d f16 | dmin f16 | scales[12] -> per-group scale and min, (n, 8, 1)."""
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    return (d * sc).reshape(n, 8, 1), (dmin * mn).reshape(n, 8, 1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 144 bytes: d f16 | dmin f16 | scales[12] | qs[128]
    # 8 groups of 32; qs: 4 chunks of 32 bytes, low nibbles = group 2c, high = group 2c+1
    # y = (d * sc) * x - dmin * m
    n = blocks.shape[0]
    dl, ml = _k_scales(blocks)
    q = _nibbles(blocks[:, 16:144].reshape(n * 4, 32)).reshape(n, 8, 32)
    return q.to(torch.float32).mul_(dl).sub_(ml).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # 176 bytes: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    # as Q4_K, plus a 5th bit: bit g of qh[l] belongs to element l of group g
    n = blocks.shape[0]
    dl, ml = _k_scales(blocks)
    ql = _nibbles(blocks[:, 48:176].reshape(n * 4, 32)).reshape(n, 8, 32)
    qh = _bits(blocks[:, 16:48])  # (n, 8, 32)
    q = ql | (qh << 4)
    return q.to(torch.float32).mul_(dl).sub_(ml).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 210 bytes: ql[128] | qh[64] | scales int8[16] | d f16
    # two halves of 128 elements: ql half = 64 bytes (low nibbles -> elements 0-63, high
    # nibbles -> 64-127), qh half = 32 bytes (2-bit fields -> elements 0-31, 32-63, ...)
    # x = (ql | qh << 4) - 32; 16 groups of 16; y = (d * scale) * x
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, 0:128].reshape(n * 2, 64)).reshape(n, 8, 32)
    qh = _crumbs(blocks[:, 128:192].reshape(n * 2, 32)).reshape(n, 8, 32)
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)
    d = _f16(blocks[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    return q.to(torch.float32).mul_(dl).reshape(n, QK_K)


_KERNELS: dict[GGMLQuantizationType, Kernel] = {
    T.F32: _f32,
    T.F16: _f16_kernel,
    T.BF16: _bf16,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}


assert frozenset(_KERNELS) == NATIVE_TYPES, "tensor_formats.NATIVE_TYPES must list the kernels"


def native_types() -> frozenset[GGMLQuantizationType]:
    """The types dequantized by the torch kernels (on any device)."""
    return NATIVE_TYPES


def supported_types() -> frozenset[GGMLQuantizationType]:
    """Every type `dequantize` accepts: the torch kernels plus gguf-py's numpy fallback."""
    return readable_types()


# ---- entry point ---------------------------------------------------------------------------


def _as_torch_bytes(raw: np.ndarray) -> torch.Tensor:
    """A flat uint8 torch view of `raw` (a copy only when it is non-contiguous or misaligned)."""
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if flat.ctypes.data % 16:
        flat = flat.copy()
    with warnings.catch_warnings():
        # GGUFFile hands out read-only views of its mmap; the kernels never write to them.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(flat)


def dequantize(
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The tensor stored as `raw` bytes of `ggml_type`, as `dtype` of `shape` on `device`."""
    try:
        ggml_type = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise ModelError(f"Unknown tensor type {ggml_type!r}; this app cannot read it.") from None
    if ggml_type not in _KERNELS and ggml_type not in gguf_quants._type_traits:
        raise ModelError(
            f"Tensor type {ggml_type.name} is not supported: this app cannot dequantize it. "
            "Try a model file quantized differently (for example Q4_K_M or Q8_0)."
        )
    shape = tuple(int(d) for d in shape)
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ModelError(
            f"A {ggml_type.name} tensor of shape {shape} is invalid: rows of {row} values do not "
            f"fit {ggml_type.name} blocks of {block_size}."
        )
    n_blocks = n_elements // block_size
    if raw.nbytes != n_blocks * type_size:
        raise ModelError(
            f"A {ggml_type.name} tensor of shape {shape} needs {n_blocks * type_size:,} bytes "
            f"but {raw.nbytes:,} were given; the model file is corrupt."
        )

    kernel = _KERNELS.get(ggml_type)
    if kernel is None:
        return _dequantize_fallback(raw, ggml_type, shape, row // block_size * type_size, device, dtype)
    if n_elements == 0:
        return torch.empty(shape, dtype=dtype, device=device)

    device = torch.device(device)
    data = _as_torch_bytes(raw).to(device).view(n_blocks, type_size)
    out = torch.empty((n_blocks, block_size), dtype=dtype, device=device)
    chunk = max(1, (_CPU_CHUNK_ELEMENTS if device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS) // block_size)
    for start in range(0, n_blocks, chunk):
        out[start : start + chunk] = kernel(data[start : start + chunk])
    return out.reshape(shape)


def dequantize_rows(data: torch.Tensor, ggml_type: GGMLQuantizationType, cols: int) -> torch.Tensor:
    """Whole rows of a tensor with a torch kernel: uint8 [n, row_bytes] (rows gathered from a
    larger tensor, already checked when it was loaded) -> float32 [n, cols], with none of
    `dequantize`'s checks and copies (a screened head dequantizes ~1,024 rows a token)."""
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    return _KERNELS[ggml_type](data.reshape(-1, type_size)).reshape(data.shape[0], cols)


def _dequantize_fallback(
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    row_bytes: int,
    device: str | torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """gguf-py's numpy dequantization, for the types without a torch kernel."""
    if raw.nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, row_bytes)
    values = np.ascontiguousarray(gguf_quants.dequantize(rows, ggml_type), dtype=np.float32)
    return torch.from_numpy(values).reshape(shape).to(device=device, dtype=dtype)
