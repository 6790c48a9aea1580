"""Building blocks every decoder family shares: RMSNorm, RoPE (both layouts, with frequency
scaling), gated-MLP activations, soft-capping, and the linear/weight-format code.

Shapes: S sequences, T tokens each, d = d_model, H heads, D head dim, R rotary dims (<= D).
Everything numerically delicate (norms, RoPE angles) is computed in float32 whatever the
activation dtype, as the reference implementations do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

from app.models.int8_products import BYTES, FIVES, Int8Codes, as_bytes
from app.models.quantized import (Int4Codes, QuantizedWeight, RawTensor, exact_top,
                                  int4_kernel_available, int4_linear, kernel_planes,
                                  pack_int8_raw, pack_raw, screen_raw, screens)


# ---- normalisation -------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight (None: no weight), in float32. Gemma's "(1 + w)"
    is folded into `weight` at load time (GGUF files store it folded already), so one
    formula serves all."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        # The same formula as one op (five fewer dispatches a call; 120 calls a decode step).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf if weight is None else xf * weight).to(x.dtype)


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
        """[R/2] float32, computed as transformers does (int64 arange -> float -> pow); the
        same tensor for every call (`_constants`): a decode step takes the tables every
        step, and these few operations had been ~70 us of it."""
        return _constants(self, torch.device(device))[0]

    def _inverse_frequencies(self, device: torch.device) -> torch.Tensor:
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

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [S, T] -> cos, signed sin [S, T, 1, R] for `rotate` on [S, T, heads, D]:
        the same tables with the sign of the rotation folded into sin (minus on each pair's
        first member), so rotating is a swap of the pair's members and one multiply-add."""
        cos, sin = self.tables(positions, dtype)  # [S, 1, T, R]
        sign = _constants(self, sin.device)[1]
        sin = sin * (sign if sin.dtype == torch.float32 else sign.to(sin.dtype))
        return cos.transpose(1, 2), sin.transpose(1, 2)


@lru_cache(maxsize=64)
def _constants(spec: RopeSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A spec's inverse frequencies [R/2] and its rotation's signs [R] (float32, minus on
    each pair's first member), made once a spec and device: read-only."""
    half = spec.rotary_dim // 2
    if spec.style == ROPE_HALF:
        sign = torch.cat((torch.full((half,), -1.0), torch.ones(half)))
    else:
        sign = torch.tensor([-1.0, 1.0]).repeat(half)
    return spec._inverse_frequencies(device), sign.to(device)


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


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, style: str) -> torch.Tensor:
    """`apply_rope` with the tables of `RopeSpec.rotation`: x [..., D], cos/signed_sin
    broadcasting to x's first R dims. x * cos + swap(x) * signed_sin, where swap exchanges
    each rotated pair's members ((i, i + R/2) for rotate-half, (2i, 2i + 1) interleaved):
    three kernels where `apply_rope` takes five (it runs twice a layer, per step)."""
    rotary = cos.shape[-1]
    head, tail = (x, None) if rotary == x.shape[-1] else (x[..., :rotary], x[..., rotary:])
    if style == ROPE_HALF:
        swapped = head.roll(rotary // 2, dims=-1)
    elif head.numel() <= _GATHER_SWAP_MAX:
        # A decode step's few rows: one gather by a fixed order (1, 0, 3, 2, ...) instead of
        # three calls. Over a prefill chunk the gather along the last dim is the slow one
        # (512 rows of SmolLM2's 12 heads: 1.7 ms against 0.24).
        swapped = head.index_select(-1, _pair_swap(rotary, head.device))
    else:
        swapped = head.unflatten(-1, (rotary // 2, 2)).flip(-1).flatten(-2)
    out = torch.addcmul(head * cos, swapped, signed_sin)
    return out if tail is None else torch.cat((out, tail), dim=-1)


_PAIR_SWAPS: dict[tuple[int, torch.device], torch.Tensor] = {}
_GATHER_SWAP_MAX = 16 * 1024  # elements: a few rows of heads (8 rows of 32 x 64)


def _pair_swap(rotary: int, device: torch.device) -> torch.Tensor:
    """[R] indices exchanging each interleaved pair's members: 1, 0, 3, 2, ..."""
    order = _PAIR_SWAPS.get((rotary, device))
    if order is None:
        order = torch.arange(rotary, device=device).view(-1, 2).flip(-1).flatten()
        _PAIR_SWAPS[(rotary, device)] = order
    return order


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
# Products of up to this many rows use a 4-bit weight's packed planes, more use its float copy
# (`wide`, when the policy measured a float kernel faster for a prefill). The 4-bit kernel's
# cost grows with the rows while a float product of a few rows costs what one row does (it
# reads the weight once), so they cross past a handful of rows. Measured on a 2-core AVX-512
# EPYC (576x1536, 2 threads; 4-bit / bfloat16 / float32 in us): 1 row 38/64/73, 4 rows
# 58/109/188, 8 rows 114/140/204, 16 rows 204/182/288. At 2, four chats streaming together
# went through the float copy: SmolLM2 4 streams 78-83 tok/s, 138-143 at 8. On CPUs without
# fast bfloat16 products (AVX2) the float side is slower still.
_INT4_NARROW_ROWS_MAX = 8


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


def linear(x: torch.Tensor, w: Weight, transposed: bool, promotes: bool = False) -> torch.Tensor:
    """x [..., in] times a weight stored [in, out] (transposed) or [out, in], or kept
    quantized (`QuantizedWeight`, whatever `transposed` says).

    The result is in x's dtype, except with `promotes`: the caller's next operation takes
    any float dtype and computes in the wider of its inputs (a residual add, a copy into the
    KV cache, RoPE's float32 tables, another product), so a 4-bit product may stay in the
    bfloat16 it comes out in: a decode step then skips ~4 conversions a layer.

    Weights may be stored narrower than the activations (e.g. float16 weights, float32
    activations); the product then runs in the weight dtype and comes back in the
    activations'. One exception, measured on the CPU: torch has a fast float16
    matrix-vector kernel but no fast float16 matrix-matrix one (16 rows: 97 ms through it
    against 76 ms upcasting the weight to float32 first), so past a few rows a float16
    weight is upcast instead.
    """
    if isinstance(w, QuantizedWeight) and on_planes(x, w):
        return int4_linear(x, w, promotes)
    if not isinstance(w, torch.Tensor):  # a float copy, [out, in] whatever the format's layout
        w, transposed = float_weight(x, w), False
    if x.dtype != w.dtype:
        rows = x.numel() // x.shape[-1]
        if w.dtype == torch.float16 and w.device.type == "cpu" and rows > _HALF_ROWS_MAX:
            return F.linear(x, w.to(x.dtype))
        return F.linear(x.to(w.dtype), w).to(x.dtype)
    return x @ w if transposed else F.linear(x, w)


def linear_from(x: torch.Tensor, w: Weight, transposed: bool, act_dtype: torch.dtype,
                promotes: bool = False) -> torch.Tensor:
    """`linear` for an input that may be narrower than the activations (`act_dtype`): a
    4-bit product's bfloat16 output, or attention's in the KV cache's dtype. A product on
    4-bit planes takes it as it is (its kernel wants that dtype: no conversion there and
    back, two dispatches a product a decode step), and so does a float weight of x's own
    dtype. Any other float weight (a 4-bit weight's float copy for a prefill chunk too)
    gets the input in `act_dtype`: otherwise its product would run, and come back, in the
    narrow dtype, and a float16 copy would be rounded to bfloat16 for it -- the slow
    bfloat16 matrix product on CPUs without AVX-512-BF16 (Gemma 3 270M's attention output
    products took 720 of a 1,024-token prefill's 2,190 ms on the AVX2 kernels). The result
    is in `act_dtype` unless `promotes` (see `linear`)."""
    if x.dtype != act_dtype and not on_planes(x, w) and x.dtype != float_weight(x, w).dtype:
        x = x.to(act_dtype)
    y = linear(x, w, transposed, promotes)
    return y if promotes or y.dtype == act_dtype else y.to(act_dtype)


def on_planes(x: torch.Tensor, w: Weight) -> bool:
    """Whether `linear` multiplies x by a 4-bit weight's packed planes, rather than by a
    float (a float weight, or a 4-bit weight's float copy for a product of many rows)."""
    return isinstance(w, QuantizedWeight) and (
        w.wide is None or x.numel() // x.shape[-1] <= w.narrow_rows_max)


def float_weight(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """The float tensor `linear` multiplies x by when not on 4-bit planes: a float weight
    itself, a `DualWeight`'s copy for x's row count, a 4-bit weight's float copy."""
    if isinstance(w, QuantizedWeight):
        return w.wide
    if isinstance(w, DualWeight):
        return w.narrow if x.numel() // x.shape[-1] <= _DUAL_NARROW_ROWS_MAX else w.wide
    return w


def fuse(weights: Sequence[Weight], transposed: bool) -> tuple[Weight, list[Weight]] | None:
    """Weights [out_i, in] with the same input, as one weight whose product is theirs side
    by side ([..., sum out_i]), and each part again as a view of it (so nothing is held
    twice); None when their kinds differ (e.g. a GGUF file's two-plane Q6_K V next to Q4_K Q and K).

    One product instead of two or three per layer is fewer dispatches and one pass over the
    activations. Parts that already lie side by side in one storage (a weight cache saved
    after fusing) are joined as a view, never copied again. 4-bit planes join row-wise: the
    kernel's packing is per 64-row tile (as `pack_raw` relies on), so every part must have
    a multiple of 64 rows (`Int8Codes` are row by row: any rows, one layout)."""
    first = weights[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(w, torch.Tensor) and w.dtype == first.dtype and w.dim() == 2
                   for w in weights):
            return None
        joined, parts = _join(list(weights), 1 if transposed else 0)
        return joined, parts
    if isinstance(first, DualWeight):
        if not all(isinstance(w, DualWeight) for w in weights):
            return None
        narrow, narrow_parts = _join([w.narrow for w in weights], 0)
        wide, wide_parts = _join([w.wide for w in weights], 0)
        return DualWeight(narrow, wide), [DualWeight(n, w) for n, w in zip(narrow_parts, wide_parts)]
    if isinstance(first, QuantizedWeight):
        layouts = {getattr(w.codes, "layout", None) for w in weights if isinstance(w, QuantizedWeight)}
        if layouts == {BYTES, FIVES}:  # 5-bit codes joining a Q8_0 weight: all as bytes
            weights = [replace(w, codes=as_bytes(w.codes)) for w in weights]
            first = weights[0]
        same = all(isinstance(w, QuantizedWeight) and w.codes.planes == first.codes.planes
                   and type(w.codes) is type(first.codes)
                   and getattr(w.codes, "layout", None) == getattr(first.codes, "layout", None)
                   and w.act_dtype == first.act_dtype and w.in_features == first.in_features
                   and w.narrow_rows_max == first.narrow_rows_max and w.rows is None
                   and (w.wide is None) == (first.wide is None)
                   and (isinstance(w.codes, Int8Codes) or w.out_features % 64 == 0)
                   for w in weights)
        if not same or first.rows is not None:
            return None
        codes, code_parts = _join_codes([w.codes for w in weights])
        wide, wide_parts = (None, [None] * len(weights)) if first.wide is None else \
            _join([w.wide for w in weights], 0)
        out = sum(w.out_features for w in weights)
        fused = QuantizedWeight(codes, out, first.in_features,
                                first.act_dtype, wide=wide, narrow_rows_max=first.narrow_rows_max)
        parts = [QuantizedWeight(code_parts[j], w.out_features,
                                 w.in_features, w.act_dtype, wide=wide_parts[j],
                                 narrow_rows_max=w.narrow_rows_max)
                 for j, w in enumerate(weights)]
        return fused, parts
    return None


def _join_codes(codes: list) -> tuple:
    """Codes of one kind (and layout and planes), joined along the outputs, and each again
    as a view of the joined."""
    first = codes[0]
    if isinstance(first, Int8Codes):  # every tensor [N, ...]: rows join, parts stay dense
        joined = [_join([getattr(c, name) for c in codes], 0) for name in ("codes", "scales", "offsets")]
        make = lambda t, s, o: Int8Codes(t, s, o, first.layout, first.planes)  # noqa: E731
        return make(*(j[0] for j in joined)), [make(*(j[1][i] for j in joined))
                                                for i in range(len(codes))]
    packed, packed_parts = _join([c.packed for c in codes], 0)
    # Scales [K/32, N, 2] join along N, so a part's are a slice of the joined ones, not
    # dense: a joined layer never multiplies by its parts, and `int4_linear` gives the
    # kernel a dense copy where one does. Held once, they are mapped from the weight
    # cache like the codes (an eighth of the codes' bytes; ~570 MB of an 8B model's
    # layers copied at every load when each part kept its own).
    sz, sz_parts = _join([c.scale_zeros for c in codes], 1)
    return (Int4Codes(packed, sz, first.planes),
            [Int4Codes(p, sz_parts[j], first.planes) for j, p in enumerate(packed_parts)])


def _join(parts: list[torch.Tensor], dim: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """parts side by side along `dim`, and each part as a view of the result."""
    joined = _adjacent(parts, dim)
    if joined is None:
        joined = torch.cat(parts, dim)
    views, offset = [], 0
    for p in parts:
        views.append(joined.narrow(dim, offset, p.shape[dim]))
        offset += p.shape[dim]
    return joined, views


def _adjacent(parts: list[torch.Tensor], dim: int) -> torch.Tensor | None:
    """The view covering `parts` when they already lie side by side along `dim` in one
    storage with the same strides, else None."""
    first = parts[0]
    storage = first.untyped_storage()
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    offset = first.storage_offset()
    for p in parts:
        if (p.untyped_storage().data_ptr() != storage.data_ptr() or p.stride() != first.stride()
                or p.storage_offset() != offset or p.dtype != first.dtype
                or [n for i, n in enumerate(p.shape) if i != dim]
                != [n for i, n in enumerate(first.shape) if i != dim]):
            return None
        offset += p.shape[dim] * p.stride(dim)
    end = first.storage_offset() + sum((n - 1) * st for n, st in zip(shape, first.stride())) + 1
    if end * first.element_size() > storage.nbytes():
        return None
    return first.as_strided(shape, first.stride(), first.storage_offset())


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
    # 4-bit weights multiplied by activations quantized to 8 bits (`app.models.int8_products`)
    # rather than by torch's kernel; weights whose inputs that kernel cannot take keep torch's.
    int8_acts: bool = False

    def wants_raw(self, ggml_type, output_rows: int = 0) -> bool:
        """Whether a linear weight stored as `ggml_type` should reach `prepare` as its raw
        blocks (a `RawTensor`) rather than dequantized to float32; `output_rows`: it is the
        output projection of that many tokens, which may be screened (`screens`)."""
        return self.int4 and int4_kernel_available() and (
            kernel_planes(ggml_type) > 0 or screens(ggml_type, output_rows))

    def prepare(self, w: torch.Tensor | RawTensor, keep_rows: bool = False,
                output: bool = False) -> Weight:
        """A float32 [out, in] weight, or a GGUF tensor's raw blocks, -> what `linear`
        multiplies by. `keep_rows` (a tied embedding) keeps what `gather_rows` needs.
        `output`: the output projection, which a step runs for its last rows only (no wide
        copy) and whose raw blocks, unless one 4-bit plane, may become a screen (`screens`).
        Raw blocks kept as `rows` are `w`'s own, a view of the model file while it loads:
        the loader copies them only when the model will not run from its saved entry
        (`TransformerLM.own_file_views`), so a first load that saves one never holds them
        twice (Gemma 3 270M's tied Q8_0 table: 178 MB)."""
        if isinstance(w, RawTensor) and output and self.int4 and screens(w.ggml_type, w.shape[0]):
            screen = screen_raw(w, self.int4_act_dtype, self.int8_acts)
            return QuantizedWeight(screen, w.shape[0], w.shape[1], self._act_dtype(screen), narrow_rows_max=_INT4_NARROW_ROWS_MAX, rows=w,
                                   exact_top=exact_top(w.shape[0]))
        many_rows = not output
        if isinstance(w, RawTensor):
            codes = None
            if self.int4 and self.int8_acts:
                codes = pack_int8_raw(w)
            if self.int4 and codes is None:
                codes = pack_raw(w, self.int4_act_dtype)
            if codes is not None:
                wide = None
                if self.int4_wide_dtype is not None and many_rows:
                    wide = w.dequantize().to(self.int4_wide_dtype)
                return QuantizedWeight(codes, w.shape[0], w.shape[1],
                                       self._act_dtype(codes), wide=wide,
                                       narrow_rows_max=_INT4_NARROW_ROWS_MAX,
                                       rows=w if keep_rows else None)
            w = w.dequantize()
        if self.wide_dtype is not None and many_rows:
            return DualWeight(w.to(self.dtype), w.to(self.wide_dtype))
        return (w.t().contiguous() if self.transposed else w).to(self.dtype)

    def _act_dtype(self, codes) -> torch.dtype:
        return torch.float32 if isinstance(codes, Int8Codes) else self.int4_act_dtype

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
            acts = "int8" if self.int8_acts else _short(self.int4_act_dtype)
            return f"int4({acts}{wide})+" + "+".join(names)
        return "+".join(names)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
