"""Weights that stay quantized at run time: GGUF blocks mapped onto torch's 4-bit weight-only
matrix product (`aten._weight_int4pack_mm_for_cpu`), with no re-quantization of floats.

The kernel multiplies by w = (c - 8) * scale + zero, with c a 4-bit code and one (scale,
zero) pair per group of 32 inputs of each output row (checked numerically in the tests).
Every GGUF block type whose groups are 32 values with one scale and one offset fits that
form exactly once written as

    w = s * (lo + 16 * h) + b        lo in 0..15, h a small signed integer (or absent)

  Q4_0  s = d,       b = -8d,     no h         (one 4-bit plane)
  Q4_1  s = d,       b = m,       no h
  Q4_K  s = d*sc_g,  b = -dmin*m_g, no h       (eight groups of 32 per 256-block)
  Q5_0  s = d,       b = -16d,    h = 5th bit  (two planes: lo, and h with scale 16s)
  Q5_1  s = d,       b = m,       h = 5th bit
  Q5_K  s = d*sc_g,  b = -dmin*m_g, h = 5th bit
  Q8_0  s = d,       b = 0,       lo = q & 15, h = q >> 4 (signed, -8..7)

Plane one: codes lo, scale s, zero b + 8s. Plane two (when h exists): codes h + 8, scale 16s,
zero 0. The sum of the two products is exactly the dequantized weight, up to the rounding of
scale and zero to the kernel's dtype. Two planes are packed side by side along the input, as
one [N, 2K] weight (`Int4Codes`), and a product takes its input twice, [x | x]: the kernel
then sums the planes in its float32 accumulators, in one call instead of two (and no float32
sum of two rounded outputs after it). Measured on a 2-core AMX Xeon: 5-10% less time a
product, Gemma 3 270M's decode step (Q5_0 Q, K, V, gate and up) 3-5% shorter.

Q2_K, Q3_K and Q6_K scale groups of 16, which the kernel's groups of 32 cannot follow. Their
weights are held as two planes too, approximately (`residual_planes`): plane one is a 4-bit
min/max quantization of the dequantized weight, plane two one of what plane one misses. Each
value is then within 1/450 of its group's range (about 8 bits; Q6_K's own step is 1/63 of a
16-group's range), so the approximation adds about a tenth to the noise Q6_K already has,
and a decode step reads two 4-bit planes instead of a float copy: Gemma 3 270M's nine Q6_K
down projections took 2.9 ms of a ~30 ms step as float32. Float tensors stay float copies.

The output projection is the exception (`screen_raw`): a step reads the whole of it for a
handful of logits that matter, so when its blocks are not one 4-bit plane already (a tied
Q8_0 embedding: two planes, ~210 MB a token for Gemma 3's 262,144 rows) and its vocabulary
is large (`SCREEN_MIN_ROWS`), it is held as a re-quantized one-plane screen plus its raw
blocks. The screen ranks every token; about the `exact_top` best of each row (one in 128 of
the vocabulary, at most 1,024) are recomputed from the blocks in float32 (`_rescored`), so
every greedy token is the exact head's. Only
tokens the screen ranks below those keep a 4-bit logit: measured on Gemma 3 270M (CPython's
LICENSE, 3,438 tokens), the model's mean NLL over float32 is +0.122% with ~1,024 rescored
(+0.108% with the exact two-plane head; +0.200% with 512, +0.391% with 256; the screen
alone cost 1.9% on 1,024 tokens); those runs scored 256 tokens a pass, so the layers ran on
their float copy and the figures are the head's. Through the 4-bit layers too (8 a pass),
`auto` measured +0.061%.

The integer codes come straight from the block bits; only s and b are computed, with the same
float32 operations `app.models.dequant` uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from app.models import head_rescoring
from app.models.dequant import (_bits, _f16, _nibbles, _scale_min_k4, dequantize, dequantize_rows,
                                native_types)
from app.models.errors import ModelError
from app.models.int8_products import (Int8Codes, byte_codes, cat_rows, fits, fits_outputs, five_codes,
                                      matmul, nibble_codes)
from app.models.load_progress import report_within

T = GGMLQuantizationType
INT4_GROUP = 32
# The kernel's inner-K tiling for the CPU packing (2 tiles of 16 codes).
_INNER_K_TILES = 2
INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0})
ONE_PLANE_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
FIVE_BIT_TYPES = frozenset({T.Q5_0, T.Q5_1, T.Q5_K})
# Blocks with groups of 16, held as two planes that approximate them (`residual_planes`).
RESIDUAL_TYPES = frozenset({T.Q2_K, T.Q3_K, T.Q6_K})
# Output projections stored in these are screened (see the module docstring): every block type
# `dequantize` reads with its torch kernels except the one-plane ones and plain floats.
SCREENED_TYPES = frozenset({T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0, T.Q2_K, T.Q3_K, T.Q6_K})
# About how many logits per row are recomputed exactly behind a screen (`exact_top`): one in
# RESCORED_SHARE of the vocabulary, at most EXACT_TOP. Measured over 3,768 tokens of CPython's
# LICENSE (`scripts/measure_weight_quality.py`, `auto`), the mean NLL against float32 and the
# mean KL divergence from it: SmolLM2 (49,152 tokens) with its exact two-plane head -0.131%,
# KL 0.00109 (its greedy tokens left float32's on both reference prompts); rescoring 1,024 /
# 512 / 384 / 256 / 128: -0.103 / -0.030 / -0.022 / -0.001 / +0.325%, KL 0.00065 / 0.00079 /
# 0.00086 / 0.00107 / 0.00503, greedy tokens float32's on both prompts. Gemma 3 (262,144):
# +0.122% with 1,024, +0.391% with 256. (The rescored logits are float32 products, the
# two-plane head's take bfloat16 activations: so the screen can score closer to float32.)
EXACT_TOP = 1024
RESCORED_SHARE = 128
# The screen saves half a two-plane head's bytes every step, while rescoring costs each row
# of logits its candidates' weight rows: it pays once the head is large. Measured on a
# 2-core AMX Xeon inside SmolLM2's decode step (the head's weights come from memory there,
# evicted by the layers': timed alone it takes ~1.7 ms, in the step ~2.7), the step with 1 /
# 4 rows of logits: two planes 13.20 / 20.86 ms, screened with 1,024 rescored 12.84 / 21.42,
# with 384 12.36 / 19.81 (medians of 8); on torch's AVX2 kernels 15.26 / 28.13 against
# 14.33 / 26.09 with 384. Gemma 3's 262,144 x 640 head alone: 13.3 -> 8.0 / 24.0 -> 17.8 ms.
SCREEN_MIN_ROWS = 32768
assert SCREENED_TYPES | RESIDUAL_TYPES <= native_types(), "dequantized by the torch kernels"
# Rows of logits rescored at a time: bounds the gathered weights when a caller asks for many
# rows (the quality script's 256); a batch of streams is one.
_RESCORE_ROWS = 16


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


_kernel_runs: bool | None = None


def int4_kernel_runs() -> bool:
    """Whether the 4-bit kernel is there and multiplies correctly here, with bfloat16
    activations (once a process, ~1 ms): a kernel torch lists may still raise on a CPU or
    build, and a format nobody measured yet is only loaded where it runs."""
    global _kernel_runs
    if _kernel_runs is None:
        _kernel_runs = False
        if int4_kernel_available():
            try:
                gen = torch.Generator().manual_seed(0)
                w = torch.randn(64, 2 * INT4_GROUP, generator=gen)
                x = torch.randn(2, 2 * INT4_GROUP, generator=gen)
                form = quantize_int4(w)
                exact = x @ form.dequantize().t()
                codes = pack_int4(form, torch.bfloat16)
                got = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.to(torch.bfloat16), codes.packed, INT4_GROUP, codes.scale_zeros).float()
                _kernel_runs = bool(torch.allclose(got, exact, rtol=0.05, atol=0.1))
            except Exception:  # noqa: BLE001 - any failure: the kernel does not run here
                pass
    return _kernel_runs


# ---- raw GGUF tensors ----------------------------------------------------------------------


@dataclass(frozen=True)
class RawTensor:
    """One GGUF tensor's stored blocks, row by row: data is uint8 [rows, row_bytes] on the CPU
    (a view of the file's memory map until something copies it); shape is torch order
    (rows, cols)."""

    data: torch.Tensor
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]

    def rows(self, start: int, end: int) -> "RawTensor":
        """Rows [start, end): whole rows are whole blocks, so slicing bytes is exact."""
        return RawTensor(self.data[start:end], self.ggml_type, (end - start, self.shape[1]))

    def dequantize(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return dequantize(self.data.numpy(), self.ggml_type, self.shape, device=device,
                          dtype=torch.float32)


@dataclass(frozen=True)
class Int4Form:
    """w = s * (lo + 16 * h) + b per group of 32 (see the module docstring).
    lo: uint8 [N, K] in 0..15 (None: scales only, `int4_form(codes=False)`); h: int8 [N, K]
    or None; s, b: float32 [N, K / 32]."""

    lo: torch.Tensor
    h: torch.Tensor | None
    s: torch.Tensor
    b: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], computed from the form (the tests compare it with `dequantize`)."""
        q = self.lo.to(torch.float32)
        if self.h is not None:
            q = q + 16 * self.h.to(torch.float32)
        N, K = q.shape
        s = self.s.repeat_interleave(INT4_GROUP, 1)
        b = self.b.repeat_interleave(INT4_GROUP, 1)
        return s * q + b


_BIT_INDEX = torch.arange(32, dtype=torch.int32)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) uint8, a little-endian u32 -> (n, 32) int8: bit j at position j (as
    dequant's `_bits_little`, in one shift instead of eight)."""
    word = qh.contiguous().view(torch.int32)  # (n, 1)
    return ((word >> _BIT_INDEX) & 1).to(torch.int8)


def int4_form(raw: RawTensor, codes: bool = True) -> Int4Form | None:
    """The exact 4-bit form of a tensor's blocks, or None for types that do not fit; without
    `codes`, a one-plane type's scales and zeros only (lo None: `pack_one_plane` takes the
    codes from the blocks' bytes as they are)."""
    t = raw.ggml_type
    if t not in INT4_TYPES:
        return None
    N, K = raw.shape
    block, size = GGML_QUANT_SIZES[t]
    blocks = raw.data.reshape(-1, size)
    n = blocks.shape[0]
    h = None
    if t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):  # blocks of 32: one group each
        d = _f16(blocks[:, 0:2])  # (n, 1)
        if t == T.Q8_0:
            q = blocks[:, 2:34].view(torch.int8)
            lo, h = (q & 15).to(torch.uint8), q >> 4  # arithmetic shift: -8..7
            b = torch.zeros_like(d)
        elif t == T.Q4_0:
            lo, b = _nibbles(blocks[:, 2:18]).reshape(n, 32) if codes else None, -8 * d
        elif t == T.Q4_1:
            lo, b = _nibbles(blocks[:, 4:20]).reshape(n, 32) if codes else None, _f16(blocks[:, 2:4])
        elif t == T.Q5_0:
            lo, h = _nibbles(blocks[:, 6:22]).reshape(n, 32), _fifth_bits(blocks[:, 2:6])
            b = -16 * d
        else:  # Q5_1
            lo, h = _nibbles(blocks[:, 8:24]).reshape(n, 32), _fifth_bits(blocks[:, 4:8])
            b = _f16(blocks[:, 2:4])
        s = d
    else:  # Q4_K, Q5_K: 256-blocks of eight groups of 32
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        s, b = d * sc, -(dmin * mn)  # (n, 8): as dequant's dl and -ml
        if t == T.Q4_K:
            lo = _nibbles(blocks[:, 16:144].reshape(n * 4, 32)) if codes else None
        else:
            lo = _nibbles(blocks[:, 48:176].reshape(n * 4, 32))
            h = _bits(blocks[:, 16:48]).reshape(n, 8, 32).to(torch.int8)
    groups = K // INT4_GROUP
    return Int4Form(None if lo is None else lo.reshape(N, K), None if h is None else h.reshape(N, K),
                    s.reshape(N, groups).contiguous(), b.reshape(N, groups).contiguous())


# ---- packed weights and the product --------------------------------------------------------


@dataclass(frozen=True)
class Int4Codes:
    """A weight [N, K] as the kernel's 4-bit codes: one plane, or `planes` planes side by side
    along the input ([N, planes * K]; a product takes its input that many times over)."""

    packed: torch.Tensor  # the kernel's packing of [N, planes * K] 4-bit codes
    scale_zeros: torch.Tensor  # [planes * K / 32, N, 2] in the activation dtype
    planes: int = 1


# A weight's codes for one of the two kernels: torch's 4-bit one (`Int4Codes`), or the one
# that quantizes the activations to 8 bits (`app.models.int8_products.Int8Codes`).
Codes = Int4Codes | Int8Codes


def codes_tensors(codes: Codes) -> tuple[torch.Tensor, ...]:
    """Every tensor `codes` holds."""
    if isinstance(codes, Int8Codes):
        return codes.codes, codes.scales, codes.offsets
    return codes.packed, codes.scale_zeros


@dataclass(frozen=True)
class QuantizedWeight:
    """One [out, in] linear weight as one or two 4-bit planes (`codes`; their products summed).

    Products run with activations in `act_dtype` (the kernel's fast dtype on the machine;
    the result comes back in the caller's dtype); `Int8Codes` (see
    `app.models.int8_products`) take float32 or bfloat16, round it to 8 bits themselves,
    and their `act_dtype` is float32. With `wide`, products of more than
    `narrow_rows_max` rows use that float copy instead (prefill, when the policy measured
    a float kernel faster for many rows). `rows` keeps the raw blocks of a tied embedding
    so token lookups dequantize exactly the rows they need. With `exact_top` the codes are
    a screen of the weight in `rows` (an output projection, see the module docstring): a
    product's `exact_top` largest outputs per row are recomputed from `rows` in float32."""

    codes: Codes
    out_features: int
    in_features: int
    act_dtype: torch.dtype
    wide: torch.Tensor | None = None
    narrow_rows_max: int = 2
    rows: RawTensor | None = None
    exact_top: int = 0

    @property
    def device(self) -> torch.device:
        return codes_tensors(self.codes)[0].device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.act_dtype

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows for token ids [n] -> float32 [n, in]."""
        if self.rows is None:
            raise ModelError("This quantized weight keeps no embedding rows.")
        picked = self.rows.data.index_select(0, ids.cpu())
        if self.rows.ggml_type in native_types():  # straight to the block kernel: ~0.1 ms a step
            return dequantize_rows(picked, self.rows.ggml_type, self.in_features).to(ids.device)
        raw = RawTensor(picked, self.rows.ggml_type, (ids.numel(), self.in_features))
        return raw.dequantize(ids.device)


# The rows the kernel's packing interleaves on this machine (`_packing_rows`): unknown until
# probed, then a row count, or 0 where no plain interleaving matches.
_packing_rows_found: int | None = None


def _packing_rows() -> int:
    """How the 4-bit kernel's packing lays codes out here, found once by packing a small
    matrix with torch's packing and comparing: its CPU kernels take the weight as tiles of
    `rows` output rows, byte (tile, k, n) holding row n's code for input k in its low nibble
    and row n + rows / 2's in its high one (64 rows with torch's AVX-512 kernels, 32 with
    its AVX2 ones). 0 where neither matches (the portable kernel's own layout)."""
    global _packing_rows_found
    if _packing_rows_found is None:
        _packing_rows_found = 0
        if int4_kernel_available():
            codes = torch.randint(0, 16, (128, 2 * INT4_GROUP), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(0))
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    codes.to(torch.int32), _INNER_K_TILES)
                for rows in (64, 32):
                    if torch.equal(packed.view(torch.uint8), _interleaved(codes, rows)):
                        _packing_rows_found = rows
                        break
            except Exception:  # noqa: BLE001 - any failure: torch's packing does it all
                pass
    return _packing_rows_found


def _interleaved(codes: torch.Tensor, rows: int) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 -> uint8 [N, K / 2] laid out as `_packing_rows` says."""
    N, K = codes.shape
    tiles = codes.view(N // rows, 2, rows // 2, K)
    return _tile_major(tiles[:, 0] | (tiles[:, 1] << 4))


def _tile_major(pairs: torch.Tensor) -> torch.Tensor:
    """uint8 [tiles, rows / 2, K], byte (t, n, k) holding rows n and n + rows / 2 of tile t
    for input k -> the kernel's [tiles, K, rows / 2] order, as [N, K / 2]."""
    tiles, half_rows, K = pairs.shape
    return pairs.transpose(1, 2).contiguous().view(tiles * half_rows * 2, K // 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 -> the 4-bit kernel's packed weight. In uint8 where this
    machine's packing is known, as torch's packing makes it byte for byte (the probe): that
    packing takes the codes as int32, four bytes a code, and took ~2.6 s of a 1.8 GB model's
    ~12 s first load in conversions alone (38 against 9 ms for an 8192 x 3072 weight)."""
    rows = _packing_rows()
    if rows and codes.shape[0] % rows == 0:
        return _interleaved(codes, rows)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), _INNER_K_TILES)


# Where a one-plane type's blocks keep their codes, (offset of the code bytes in a block,
# half): byte l of each run of `half` code bytes holds code l of a run of 2 * half codes
# (low nibble) and code l + half (high nibble) (`pack_one_plane`).
_NIBBLE_RUNS = {T.Q4_0: (2, 16), T.Q4_1: (4, 16), T.Q4_K: (16, 32)}


def pack_one_plane(raw: RawTensor, act_dtype: torch.dtype) -> Int4Codes | None:
    """`pack_int4(int4_form(raw))` for a one-plane type's blocks, byte for byte, with the
    codes taken from the blocks' bytes into the kernel's layout directly instead of unpacked
    to a byte each and packed again (a 1.8 GB Q4_1 model's first load 8.7-8.8 -> 8.0-8.4 s);
    None where this machine's packing is not known (`_packing_rows`) or the rows do not fill
    its tiles."""
    rows = _packing_rows()
    N, K = raw.shape
    if raw.ggml_type not in _NIBBLE_RUNS or not rows or N % rows:
        return None
    start, half = _NIBBLE_RUNS[raw.ggml_type]
    block, size = GGML_QUANT_SIZES[raw.ggml_type]
    nibble_bytes = block // 2
    qs = raw.data.reshape(N, K // block, size)[:, :, start:start + nibble_bytes]
    # [tiles, 2 (row n, row n + rows / 2), rows / 2, runs, half]
    runs = qs.reshape(N // rows, 2, rows // 2, K // (2 * half), half)
    a, b = runs[:, 0], runs[:, 1]
    first = (a & 0x0F) | (b << 4)  # codes l of each run: row n low, row n + rows / 2 high
    second = (a >> 4) | (b & 0xF0)  # codes l + half
    # [tiles, rows / 2, K]: code k = run * 2 * half + l, then + half
    packed = _tile_major(torch.stack((first, second), dim=3).view(N // rows, rows // 2, K))
    form = int4_form(raw, codes=False)
    return Int4Codes(packed, _scale_zeros(form.s, form.b + 8 * form.s, act_dtype), 1)


def _check_finite(scale: torch.Tensor, zero: torch.Tensor) -> None:
    if not (torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        raise ModelError("A quantized weight has NaN or infinite scales; the file is damaged.")


def _scale_zeros(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 [N, K / 32] each -> the kernel's [K / 32, N, 2] in `dtype`, after checking
    they are finite."""
    _check_finite(scale, zero)
    return torch.stack((scale.t(), zero.t()), dim=-1).to(dtype).contiguous()


def _pack(planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype: torch.dtype
          ) -> Int4Codes:
    """Planes (codes uint8 [N, K] in 0..15, scale and zero float32 [N, K / 32]) side by side."""
    codes, scale, zero = (torch.cat(parts, 1) if len(planes) > 1 else parts[0]
                          for parts in zip(*planes))
    return Int4Codes(pack_codes(codes), _scale_zeros(scale, zero, dtype), len(planes))


def pack_int4(form: Int4Form, act_dtype: torch.dtype) -> Int4Codes:
    """The kernel's codes for `form` (see the module docstring for the algebra)."""
    planes = [(form.lo, form.s, form.b + 8 * form.s)]
    if form.h is not None:
        planes.append(((form.h + 8).to(torch.uint8), 16 * form.s, torch.zeros_like(form.s)))
    return _pack(planes, act_dtype)


# Rows packed at a time: bounds the int32 codes and other temporaries of a large weight (a
# 262,144-row output projection would otherwise need ~1 GB of them at once). A multiple of
# the kernel's 64-row tiles, so packing chunks and concatenating equals packing the whole.
PACK_ROWS = 8192


def kernel_planes(ggml_type) -> int:
    """4-bit planes a weight stored as `ggml_type` keeps (`pack_raw`); 0: it stays a float."""
    if ggml_type in ONE_PLANE_TYPES:
        return 1
    return 2 if ggml_type in INT4_TYPES or ggml_type in RESIDUAL_TYPES else 0


def pack_raw(raw: RawTensor, act_dtype: torch.dtype) -> Int4Codes | None:
    """The codes of `raw`'s blocks (`pack_int4(int4_form(raw))`, or `residual_planes`),
    PACK_ROWS rows at a time; None for types that do not fit (`kernel_planes` 0)."""
    if not kernel_planes(raw.ggml_type):
        return None
    rows = raw.shape[0]
    return _cat_rows([_reported(_pack_rows(raw.rows(start, min(rows, start + PACK_ROWS)), act_dtype),
                                start, rows) for start in range(0, rows, PACK_ROWS)])


def _reported(chunk, start: int, rows: int):
    """chunk, the rows from `start` of `rows` prepared: the load's progress is told so, for
    every chunk but the last (the loader reports a tensor's end itself, and most weights are
    one chunk)."""
    if start + PACK_ROWS < rows:
        report_within((start + PACK_ROWS) / rows)
    return chunk


def _cat_rows(chunks: list[Int4Codes]) -> Int4Codes:
    """Codes packed for consecutive row ranges (multiples of the kernel's 64-row tiles), as one."""
    if len(chunks) == 1:
        return chunks[0]
    return Int4Codes(torch.cat([c.packed for c in chunks]),
                     torch.cat([c.scale_zeros for c in chunks], dim=1), chunks[0].planes)


def _pack_rows(raw: RawTensor, act_dtype: torch.dtype) -> Int4Codes:
    if raw.ggml_type in INT4_TYPES:
        direct = pack_one_plane(raw, act_dtype)
        return direct if direct is not None else pack_int4(int4_form(raw), act_dtype)
    return residual_planes(raw.dequantize(), act_dtype)  # (quantize_int4 checks the values)


def residual_planes(w: torch.Tensor, act_dtype: torch.dtype) -> Int4Codes:
    """Two planes whose products sum to about float32 w [N, K]: plane one quantizes w to 4
    bits (min/max per group of 32), plane two the residual w - plane one, where plane one is
    taken as the kernel applies it (its scale and zero rounded to `act_dtype`). Each value
    lands within half a step of plane two, 1/450 of its group's range."""
    first = quantize_int4(w)
    scale, zero = first.s, first.b + 8 * first.s
    kept_scale = scale.to(act_dtype).float().repeat_interleave(INT4_GROUP, 1)
    kept_zero = zero.to(act_dtype).float().repeat_interleave(INT4_GROUP, 1)
    residual = w - ((first.lo.to(torch.float32) - 8) * kept_scale + kept_zero)
    second = quantize_int4(residual)
    return _pack([(first.lo, scale, zero), (second.lo, second.s, second.b + 8 * second.s)],
                 act_dtype)


def int8_codes(form: Int4Form, ggml_type) -> Int8Codes:
    """An exact form (`int4_form`) for the 8-bit activation kernel: one plane of 4-bit codes;
    5-bit blocks' codes 0..31 (h in 0..1) in 5.5 bits a code; else one signed byte a code,
    lo + 16h: Q8_0's own (h in -8..7). (A Q8_0 V joining Q5_0 Q and K in one product takes
    theirs as bytes: `layers.fuse`.)"""
    if form.h is None:
        return nibble_codes([(form.lo, form.s, form.b)])
    if ggml_type in FIVE_BIT_TYPES:
        return five_codes(form.lo | (form.h.to(torch.uint8) << 4), form.s, form.b)
    return byte_codes(form.lo.to(torch.int8) + 16 * form.h, form.s, form.b)


def quantize_int8(w: torch.Tensor) -> Int8Codes:
    """float32 w [N, K] as one signed byte a value (min/max per group of 32): each within
    half a step, 1/510 of its group's range (and the float16 rounding of the group's
    offset), as close as `residual_planes`' two 4-bit planes (1/450) in one plane. For the
    groups of 16 of Q2_K, Q3_K and Q6_K, which the 8-bit activation kernel's groups of 32
    cannot follow either."""
    N, K = w.shape
    g = w.reshape(N, K // INT4_GROUP, INT4_GROUP)
    lo_v, hi_v = _group_range(g, "A quantized weight")
    # the step and the offset as the kernel keeps them (float16), the codes against those
    s = ((hi_v - lo_v) / 255).clamp_min(1e-7).to(torch.float16).float()
    b = (lo_v + 128 * s).to(torch.float16).float()
    codes = (g - b[..., None]).div_(s[..., None]).round_().clamp_(-128, 127)
    return byte_codes(codes.to(torch.int8).reshape(N, K), s, b)


def _int8_rows(raw: RawTensor) -> Int8Codes:
    if raw.ggml_type in INT4_TYPES:
        form = int4_form(raw)
        _check_finite(form.s, form.b)
        return int8_codes(form, raw.ggml_type)
    return quantize_int8(raw.dequantize())


def pack_int8_raw(raw: RawTensor) -> Int8Codes | None:
    """`pack_raw` for the 8-bit activation kernel; None where it has no form for `raw`
    (`kernel_planes` 0), its inputs are not whole pairs of blocks (`fits`) or its outputs
    not whole groups of 8 (`fits_outputs`)."""
    if not kernel_planes(raw.ggml_type) or not fits(raw.shape[1]) or not fits_outputs(raw.shape[0]):
        return None
    rows = raw.shape[0]
    return cat_rows([_reported(_int8_rows(raw.rows(start, min(rows, start + PACK_ROWS))), start, rows)
                     for start in range(0, rows, PACK_ROWS)])


def _group_range(groups: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (min, max) of [N, groups, 32]; ModelError naming `what` when any value
    is NaN or infinite (the minima and maxima carry them: `aminmax` propagates NaN)."""
    lo_v, hi_v = torch.aminmax(groups, dim=-1)
    if not (torch.isfinite(lo_v).all() and torch.isfinite(hi_v).all()):
        raise ModelError(f"{what} contains NaN or infinite values; the file is damaged.")
    return lo_v, hi_v


def quantize_int4(w: torch.Tensor, what: str = "A quantized weight") -> Int4Form:
    """A 4-bit form for a float weight (as Q4_1: min/max per group of 32): for an output
    projection's screen, whose top logits are recomputed exactly, for the planes of
    `residual_planes`, and for timing candidate kernels on a model's shapes; never a
    weight's only form. Raises ModelError, naming `what`, when w holds NaN or infinities:
    the groups' minima and maxima carry them (`aminmax` propagates NaN), so checking
    those is checking every value, at a 32nd of the reads (Gemma 3's 168M-value screen:
    0.33 s of a ~3.5 s first load checked whole)."""
    N, K = w.shape
    g = w.reshape(N, K // INT4_GROUP, INT4_GROUP)
    lo_v, hi_v = _group_range(g, what)
    s = ((hi_v - lo_v) / 15).clamp_min(1e-8)
    # in place on one temporary: half the time of a new tensor per operation, the same codes
    codes = (g - lo_v[..., None]).div_(s[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return Int4Form(codes.reshape(N, K), None, s, lo_v)


def screens(ggml_type, rows: int) -> bool:
    """Whether an output projection of `rows` tokens stored as `ggml_type` is screened."""
    return ggml_type in SCREENED_TYPES and rows >= SCREEN_MIN_ROWS


def exact_top(rows: int) -> int:
    """About how many of each row's logits a screened output projection of `rows` tokens
    recomputes exactly (see RESCORED_SHARE)."""
    return max(1, min(EXACT_TOP, rows // RESCORED_SHARE))


def screen_raw(raw: RawTensor, act_dtype: torch.dtype, int8: bool = False) -> Codes:
    """A one-plane screen of an output projection's blocks, PACK_ROWS rows at a time (the
    float32 rows of a 262,144-row table would be 671 MB at once); for the 8-bit activation
    kernel with `int8` (where its inputs fit)."""
    if raw.ggml_type not in SCREENED_TYPES:
        raise ValueError(f"{raw.ggml_type.name} weights are not screened")
    int8 = int8 and fits(raw.shape[1]) and fits_outputs(raw.shape[0])
    chunks = []
    for start in range(0, raw.shape[0], PACK_ROWS):
        w = raw.rows(start, min(raw.shape[0], start + PACK_ROWS)).dequantize()
        form = quantize_int4(w, "The output projection")
        codes = nibble_codes([(form.lo, form.s, form.b)]) if int8 else pack_int4(form, act_dtype)
        chunks.append(_reported(codes, start, raw.shape[0]))
    return cat_rows(chunks) if int8 else _cat_rows(chunks)


def _screened_top(out: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Ids of about k of each row's largest values in out [n, V], one tensor a row, ids
    ascending: every id at or above its row's threshold, read off a strided sample of the
    row, so each row's set always holds its best. numpy's `partition` finds each sample's
    threshold; the ids are one compiled pass over every row (`head_rescoring.select_at_least`,
    the rows on torch's threads: four rows of 262,144 ~91 us against numpy's comparison and
    `flatnonzero`, ~307 us, on a 2-core AMD EPYC), or numpy's where the kernel does not run.
    (torch's `topk`, comparison, `nonzero` and split had taken ~100 / ~265 us for one row
    and ~250 / ~650 for four; its exact top-k over 262,144 logits takes ~1 ms.)"""
    n, vocab = out.shape
    stride = vocab // (4 * k)  # a sample of ~4k values a row, ~k // stride of them above
    if stride < 2:
        return list(out.topk(min(k, vocab), dim=-1, sorted=False).indices.sort(-1).values)
    values = out.detach().cpu()
    rows = values.numpy()
    above = max(1, k // stride)
    leasts = []
    for row in rows:
        sample = row[::stride]
        leasts.append(np.partition(sample, sample.size - above)[sample.size - above])
    bound = 2 * k  # more ids than this: a row unlike its sample (many equal values)
    if head_rescoring.selects(values):  # one compiled pass for every row, the same ids
        ids, counts = head_rescoring.select_at_least(values, torch.tensor(leasts), bound)
        found = [ids[r, :c] if c <= bound else None for r, c in enumerate(counts.tolist())]
    else:
        found = [torch.from_numpy(np.flatnonzero(row >= least)) for row, least in zip(rows, leasts)]
        found = [f if f.numel() <= bound else None for f in found]
    per_row = []
    for row, ids in zip(rows, found):
        if ids is None:  # bound the work: the row's k best
            ids = torch.from_numpy(np.sort(np.argpartition(row, vocab - k)[vocab - k:]))
        per_row.append(ids.to(out.device))
    return per_row


def _rescored(x: torch.Tensor, screened: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [n, in], the screen's products [n, out] -> float32 [n, out] with about
    `w.exact_top` of each row's largest recomputed from the raw rows: the candidates chosen
    _RESCORE_ROWS rows at a time, all of those rows' in one compiled call where it serves
    (`head_rescoring`: one parallel region for a batch of streams; a call a row had cost
    each row its own region and Python, the helper thread waking for the first), else the
    weights gathered a row at a time (float32, ~2.6 MB for 1,024 of 640) and multiplied by
    that row of x in place (a gathered copy of x per weight row and a second product buffer
    cost ~0.25 ms a row more).

    Each exact value is one weight row's elementwise product with x's row, summed over
    `in` (not a matrix product, whose sums depend on how many rows it is given): it does not
    depend on which other rows or tokens are rescored with it, so batching and chunking
    change no logit the screen ranks near the top."""
    out = screened.float()
    xf = x.float()
    compiled = head_rescoring.serves(w.rows.ggml_type, xf)
    for start in range(0, out.shape[0], _RESCORE_ROWS):
        part = out[start: start + _RESCORE_ROWS]
        chosen = _screened_top(part, w.exact_top)
        if compiled:  # the rows read in place, every row's candidates in one call
            ids = torch.cat(chosen)
            # (numpy's repeat: torch's repeat_interleave took ~21 us against ~7)
            which = torch.from_numpy(np.repeat(np.arange(len(chosen)), [len(c) for c in chosen]))
            exact = head_rescoring.rescore(xf[start: start + len(chosen)], w.rows.data, ids, which)
            part.index_put_((which, ids), exact)
            continue
        for r, row_ids in enumerate(chosen):
            weights = dequantize_rows(w.rows.data.index_select(0, row_ids), w.rows.ggml_type,
                                      w.in_features)
            part[r].index_put_((row_ids,), weights.mul_(xf[start + r]).sum(-1))
    return out


def int4_linear(x: torch.Tensor, w: QuantizedWeight, promotes: bool = False,
                norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype, on the packed planes (`layers.linear` sends
    products of more than `narrow_rows_max` rows to the float copy instead). With
    `promotes` (see `layers.linear`) the result stays in the dtype the product comes out
    in: `act_dtype`. `norm`: the product is of x's RMS norm times `norm` (`Int8Codes` only,
    which compute it as they round x: `int8_products.matmul`)."""
    lead = x.shape[:-1]
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the kernel takes [rows, in]
    codes = w.codes
    if norm is not None and (not isinstance(codes, Int8Codes) or w.exact_top):
        raise ValueError("only a product on 8-bit activations takes its input's norm")
    if isinstance(codes, Int8Codes):  # float32 or bfloat16 in, float32 out
        out = matmul(flat, codes, norm, eps)
    else:
        # (dtype checks rather than no-op .to() calls: each is a dispatch, 4 a layer a step)
        a = flat if flat.dtype == w.act_dtype else flat.to(w.act_dtype)
        if codes.planes > 1:  # planes side by side: [x | x] meets them in one product
            a = torch.cat((a,) * codes.planes, dim=-1)
        scale_zeros = codes.scale_zeros
        if not scale_zeros.is_contiguous():  # a joined product's part (`layers.fuse`): the
            scale_zeros = scale_zeros.contiguous()  # kernel reads scales densely, strides or not
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(a, codes.packed, INT4_GROUP, scale_zeros)
    if w.exact_top:
        out = _rescored(flat, out, w)
    if not promotes and out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*lead, w.out_features)
