"""Building blocks every decoder family shares: RMSNorm, RoPE (both layouts, with frequency
scaling), gated-MLP activations, soft-capping, and the linear/weight-format code.

Shapes: S sequences, T tokens each, d = d_model, H heads, D head dim, R rotary dims (<= D).
Everything numerically delicate (norms, RoPE angles) is computed in float32 whatever the
activation dtype, as the reference implementations do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.models.quantized import (INT4_TYPES, QuantizedWeight, RawTensor, int4_kernel_available,
                                  int4_linear, pack_raw)


# ---- normalisation -------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, in float32. Gemma's "(1 + w)" is folded into
    `weight` at load time (GGUF files store it folded already), so one formula serves all."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


# ---- rotary position embeddings ------------------------------------------------------------

ROPE_HALF = "half"  # rotate-half (GPT-NeoX, Hugging Face): pairs (i, i + R/2)
ROPE_INTERLEAVED = "interleaved"  # GPT-J / llama.cpp's normal mode: pairs (2i, 2i + 1)


@dataclass(frozen=True)
class RopeSpec:
    """How one layer kind rotates its queries and keys.

    `freq_factors` divide the inverse frequencies one by one (Llama 3 scaling, LongRoPE), as
    llama.cpp's `rope_freqs` tensor does; `position_scale` divides positions (linear
    scaling); `attention_factor` multiplies cos and sin (LongRoPE/YaRN magnitude scaling).
    """

    base: float
    rotary_dim: int
    style: str = ROPE_HALF
    freq_factors: tuple[float, ...] | None = None
    position_scale: float = 1.0
    attention_factor: float = 1.0

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        """[R/2] float32, computed as transformers does (int64 arange -> float -> pow)."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device)
        inv = 1.0 / (self.base ** (exponents.float() / self.rotary_dim))
        if self.freq_factors is not None:
            inv = inv / torch.tensor(self.freq_factors, dtype=torch.float32, device=device)
        return inv

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [S, T] -> cos, sin [S, 1, T, R] laid out for `style`."""
        inv = self.inverse_frequencies(positions.device)
        angles = (positions.to(torch.float32) / self.position_scale)[..., None] * inv  # [S, T, R/2]
        if self.style == ROPE_HALF:
            angles = torch.cat((angles, angles), dim=-1)
        else:
            angles = angles.repeat_interleave(2, dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos[:, None].to(dtype), sin[:, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [S, H, T, D]; rotates the first R = cos.shape[-1] dims, passes the rest through."""
    rotary = cos.shape[-1]
    head, tail = (x, None) if rotary == x.shape[-1] else (x[..., :rotary], x[..., rotary:])
    if style == ROPE_HALF:
        half = rotary // 2
        rotated = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
    else:
        pairs = head.unflatten(-1, (rotary // 2, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    out = head * cos + rotated * sin
    return out if tail is None else torch.cat((out, tail), dim=-1)


def llama3_frequency_factors(head_dim: int, base: float, factor: float, low_freq_factor: float,
                             high_freq_factor: float, original_context: int) -> tuple[float, ...]:
    """Llama 3.1's per-frequency divisors (what llama.cpp's converter stores as `rope_freqs`):
    long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (base ** (i / head_dim))
        wavelen = 2 * torch.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


# ---- activations ---------------------------------------------------------------------------

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's bound on attention scores and final logits."""
    return x if cap is None else torch.tanh(x / cap) * cap


# ---- linear layers and weight formats ------------------------------------------------------


def weights_transposed(device: torch.device, dtype: torch.dtype) -> bool:
    """The weight layout each backend multiplies fastest, measured on a 2-core CPU for a
    [1, 640] x [640, 262144] product: float32 `x @ w` on [in, out] takes 33 ms against
    F.linear's 47 ms on [out, in]; in bfloat16/float16 it is the other way round
    (31 / 590 ms against 13 / 10 ms). GPUs get the standard [out, in]."""
    return device.type == "cpu" and dtype == torch.float32


_HALF_ROWS_MAX = 12
_DUAL_NARROW_ROWS_MAX = 2


@dataclass(frozen=True)
class DualWeight:
    """One [out, in] weight held twice, for the CPU: float16 for products with one or two
    rows (decode, where torch's float16 matrix-vector kernel is the fastest it has) and
    bfloat16 for more rows (prefill, batches, where bfloat16 has the fast matrix-matrix
    kernel on CPUs with AVX-512-BF16/AMX). Twice the weight memory: the dtype policy uses it
    for small models only, on CPUs where it measured it to pay."""

    narrow: torch.Tensor  # float16
    wide: torch.Tensor  # bfloat16

    @property
    def device(self) -> torch.device:
        return self.narrow.device

    @property
    def shape(self) -> torch.Size:
        return self.narrow.shape


Weight = torch.Tensor | DualWeight | QuantizedWeight


def linear(x: torch.Tensor, w: Weight, transposed: bool) -> torch.Tensor:
    """x [..., in] times a weight stored [in, out] (transposed) or [out, in], or kept
    quantized (`QuantizedWeight`, whatever `transposed` says).

    Weights may be stored narrower than the activations (e.g. float16 weights, float32
    activations); the product then runs in the weight dtype and comes back in the
    activations'. One exception, measured on the CPU: torch has a fast float16
    matrix-vector kernel but no fast float16 matrix-matrix one (16 rows: 97 ms through it
    against 76 ms upcasting the weight to float32 first), so past a few rows a float16
    weight is upcast instead.
    """
    if isinstance(w, QuantizedWeight):
        return int4_linear(x, w)
    if isinstance(w, DualWeight):  # both copies are [out, in], whatever the format's layout
        w = w.narrow if x.numel() // x.shape[-1] <= _DUAL_NARROW_ROWS_MAX else w.wide
        transposed = False
    if x.dtype != w.dtype:
        rows = x.numel() // x.shape[-1]
        if w.dtype == torch.float16 and w.device.type == "cpu" and rows > _HALF_ROWS_MAX:
            return F.linear(x, w.to(x.dtype))
        return F.linear(x.to(w.dtype), w).to(x.dtype)
    return x @ w if transposed else F.linear(x, w)


@dataclass(frozen=True)
class WeightFormat:
    """How linear weights are stored for one loaded model: dtype, layout, optional wide copy,
    and whether weights whose GGUF blocks fit the 4-bit kernel stay quantized (`int4`).

    With `int4`, fitting weights become `QuantizedWeight`s multiplied with activations in
    `int4_act_dtype`, plus a float copy in `int4_wide_dtype` for many-row products when set;
    every other linear weight follows `dtype`/`wide_dtype` as without it."""

    dtype: torch.dtype
    transposed: bool
    wide_dtype: torch.dtype | None = None
    int4: bool = False
    int4_act_dtype: torch.dtype = torch.bfloat16
    int4_wide_dtype: torch.dtype | None = None

    def wants_raw(self, ggml_type) -> bool:
        """Whether a linear weight stored as `ggml_type` should reach `prepare` as its raw
        blocks (a `RawTensor`) rather than dequantized to float32."""
        return self.int4 and ggml_type in INT4_TYPES and int4_kernel_available()

    def prepare(self, w: torch.Tensor | RawTensor, keep_rows: bool = False,
                many_rows: bool = True) -> Weight:
        """A float32 [out, in] weight, or a GGUF tensor's raw blocks, -> what `linear`
        multiplies by. `keep_rows` (a tied embedding) keeps what `gather_rows` needs;
        `many_rows=False` (the output projection, which a step runs for its last row only)
        skips the wide copy."""
        if isinstance(w, RawTensor):
            planes = pack_raw(w, self.int4_act_dtype) if self.int4 else None
            if planes is not None:
                wide = None
                if self.int4_wide_dtype is not None and many_rows:
                    wide = w.dequantize().to(self.int4_wide_dtype)
                rows = RawTensor(w.data.clone(), w.ggml_type, w.shape) if keep_rows else None
                return QuantizedWeight(planes, w.shape[0], w.shape[1],
                                       self.int4_act_dtype, wide=wide,
                                       narrow_rows_max=_DUAL_NARROW_ROWS_MAX, rows=rows)
            w = w.dequantize()
        if self.wide_dtype is not None and many_rows:
            return DualWeight(w.to(self.dtype), w.to(self.wide_dtype))
        return (w.t().contiguous() if self.transposed else w).to(self.dtype)

    def rows_table(self, w: Weight) -> torch.Tensor:
        """An embedding table [V, d] (or its transposed [d, V] form) as one plain tensor."""
        return w.narrow if isinstance(w, DualWeight) else w

    def gather_rows(self, w: Weight, ids: torch.Tensor, tied: bool) -> torch.Tensor:
        """Embedding rows for flat token ids [n] -> [n, d] (float32 from a quantized table,
        else the table's dtype). `tied`: `w` is the output projection in the linear layout."""
        if isinstance(w, QuantizedWeight):
            return w.gather_rows(ids)
        if isinstance(w, DualWeight):
            return w.narrow[ids]
        table = self.rows_table(w)
        if tied and self.transposed:
            return table.index_select(1, ids).t()
        return table[ids]

    @property
    def label(self) -> str:
        """e.g. "int4+bfloat16" or "float16+bfloat16"."""
        names = [_short(self.dtype)] + ([_short(self.wide_dtype)] if self.wide_dtype else [])
        if self.int4:
            wide = f"/{_short(self.int4_wide_dtype)}" if self.int4_wide_dtype else ""
            return f"int4({_short(self.int4_act_dtype)}{wide})+" + "+".join(names)
        return "+".join(names)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
