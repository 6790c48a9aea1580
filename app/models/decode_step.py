"""The decoder layers' decode step as TorchScript: the same operations as
`DecoderLayer.forward` in the same order, run by TorchScript's interpreter instead of Python,
every layer in one call a pass.

A decode step of a small model is ~1,000 small operations (SmolLM2 135M: 30 layers of ~35),
and on a CPU each costs more in Python -- the call, our dispatch helpers (`linear`,
`int4_linear`, the KV view's `attend`), the attribute lookups -- than in its kernel.
Measured side by side on a 2-core AVX-512 Xeon (SmolLM2, 8 runs each, alternating, same
tokens): one stream 98.1 -> 112.3 tok/s, four 210 -> 245; against llama.cpp 0.85x -> 1.20x.

Scope, checked once per layer at load (`prepare`) and per pass (`run`):
* a pass in which every sequence adds exactly one token to a KV copy that outlives the pass
  (the KV view's `decode_plan`; a pass with a prompt chunk in it takes the layers' Python
  path, where the chunk's products and attention dwarf the interpreter anyway);
* every product on 4-bit planes (`QuantizedWeight`, as many rows as the weight keeps on
  its planes), Q, K and V joined in one product without a bias, gate and up in another;
* float32 activations and norms; RoPE over the whole head; no attention soft-capping;
  SiLU or tanh-GELU; optional QK-norm and sandwich norms (Gemma 3); sliding layers;
  attention per KV head or, from the model's `per_head_from` keys, per query head.
A pass where any layer is outside it runs every layer's Python, unchanged.

Bitwise the same as that Python path (tests/models/test_decode_step.py, both built-in
models, one and several sequences, bfloat16 and float32 KV, both attention layouts): each
operation here is the one
it runs, on tensors of the same dtypes, shapes and strides. The liberties change no value:
RoPE's pair swap, a permutation, is always a gather by index here; and the views every
sequence's attention needs in every layer (its query, its slice of keys and values, its
output) are made with fewer operations than the KV view's general path makes them (each
is paid per sequence and layer; docs/performance.md has what it saved). So this is
a second spelling of the layer for one case, held to the first by those tests: a change to
`DecoderLayer.forward`, `int4_linear` or `PagedBatchView.attend` needs its twin here (the
tests fail until it has one).

TorchScript needs this file's source (the frozen build ships it: packaging/ferrox-chat.spec)
and is deprecated in favour of torch.compile, which needs a C++ compiler on the user's
machine (and its guards cost more than these kernels: docs/performance.md); where
scripting fails, `compiled()` says None and the layers keep their Python path.
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

import app.models.int8_products  # noqa: F401 - registers torch.ops.ferrox.int8_matmul, which `_int4` calls
from app.models import decode_attention  # registers torch.ops.ferrox.decode_attention
from app.models import decode_block  # registers torch.ops.ferrox.decode_block
from app.models.decode_attention import KV_KINDS

log = logging.getLogger(__name__)

# `DecodeArgs.ints`, by position (TorchScript reads no module globals, so `decode_layer`
# names them once at its top): H, Hkv, D, the planes of the qkv, o, gate_up and down
# products, then 0/1 for QK-norm, a norm after attention, a norm after the MLP, tanh-GELU,
# the 4-bit kernel's group size, the four products' kernels (-1: torch's 4-bit kernel,
# else the `Int8Codes` layout of `app.models.int8_products`), then 0/1 for attention in one
# compiled call (`app.models.decode_attention`), for rotate-half RoPE, for the norms
# before QKV and gate-up computed in those products (`DecoderLayer._norms_in_products`), and
# for the whole layer in one compiled call (`app.models.decode_block`).


@dataclass(frozen=True)
class DecodeArgs:
    """One layer's constant arguments: tensors [attn_norm, qkv packed, qkv scales, o packed,
    o scales, ffn_norm, gate_up packed, gate_up scales, down packed, down scales, RoPE pair
    swap, qk_norm, post_attn_norm, post_ffn_norm, the four products' offsets, an empty
    tensor (no norm in a product), the layer's `decode_block.constants` (or empty)] (an absent norm: an empty tensor, its flag 0; torch's
    kernel has no offsets: empty too; for `Int8Codes` "packed" are the codes) and `ints` in
    the order the comment above gives. `rows_max`: the most rows every product keeps on its
    planes."""

    tensors: list
    ints: list
    eps: float
    scale: float
    rows_max: int


def decode_layer(x: torch.Tensor, w: List[torch.Tensor], n: List[int], eps: float, scale: float,
                 cos: torch.Tensor, sin: torch.Tensor, datas: List[torch.Tensor], layer: int,
                 starts: List[int], firsts: List[int], seens: List[int],
                 per_head_from: int, attn: torch.Tensor, attn_ints: List[int]) -> torch.Tensor:
    """x [N, d] float32, one row per sequence; cos, sin [1, N, 1, D]; datas[i] sequence i's
    KV copy [n_layers, 2, Hkv, capacity, D]: it writes position starts[i] and its query sees
    seens[i] positions from firsts[i], asked per query head from `per_head_from` positions
    (-1: never; `DecoderLayer._attend`); where attention is one compiled call, `attn` is
    this layer's table of a `decode_attention.Plan` and attn_ints its kind, longest and
    threads. -> [N, d], as `DecoderLayer.forward`."""
    H, Hkv, D = n[0], n[1], n[2]
    qkv_planes, o_planes, gate_up_planes, down_planes = n[3], n[4], n[5], n[6]
    has_qk_norm, post_attn, post_ffn, gelu = n[7] != 0, n[8] != 0, n[9] != 0, n[10] != 0
    group = n[11]
    qkv_kernel, o_kernel, gate_up_kernel, down_kernel = n[12], n[13], n[14], n[15]
    fused, half, norms_in_products, block = n[16] != 0, n[17] != 0, n[18] != 0, n[19] != 0
    N = x.shape[0]
    if block and attn.numel() > 0:  # (DecoderLayer._decode_block)
        return torch.ops.ferrox.decode_block(x, w[19], cos.reshape(N, D), sin.reshape(N, D), attn,
                                             attn_ints[0], attn_ints[1], attn_ints[2])
    none = w[18]  # (an empty tensor: no norm in a product)
    # ---- attention (DecoderLayer.attention, _qkv, rotate, PagedBatchView.attend, _attend)
    plain = not has_qk_norm
    if norms_in_products:  # (DecoderLayer._normed)
        y = _int4(x, w[1], w[2], w[14], qkv_planes, qkv_kernel, group, plain, w[0], eps)
    else:
        h = F.rms_norm(x, [x.shape[-1]], w[0], eps)
        y = _int4(h, w[1], w[2], w[14], qkv_planes, qkv_kernel, group, plain, none, 0.0)
    if fused:  # (DecoderLayer._attend_decode)
        out = torch.ops.ferrox.decode_attention(y, cos.reshape(N, D), sin.reshape(N, D), w[11], attn,
                                                H, Hkv, D, half, attn_ints[0], attn_ints[1],
                                                attn_ints[2], eps, scale)
    else:
        out = _attention(y.view(1, N, H + 2 * Hkv, D), w, n, eps, scale, cos, sin, datas, layer,
                         starts, firsts, seens, per_head_from)
    h = _int4(out, w[3], w[4], w[15], o_planes, o_kernel, group, not post_attn, none, 0.0)
    if post_attn:
        h = _widen(h, x.dtype)
        h = F.rms_norm(h, [h.shape[-1]], w[12], eps)
    x = x + h
    # ---- MLP (DecoderLayer.mlp)
    if norms_in_products:
        gate_up = _int4(x, w[6], w[7], w[16], gate_up_planes, gate_up_kernel, group, True, w[5],
                        eps).chunk(2, dim=-1)
    else:
        h = F.rms_norm(x, [x.shape[-1]], w[5], eps)
        gate_up = _int4(h, w[6], w[7], w[16], gate_up_planes, gate_up_kernel, group, True, none,
                        0.0).chunk(2, dim=-1)
    gate, up = gate_up[0], gate_up[1]
    if gelu:
        gated = F.gelu(gate, approximate="tanh") * up
    else:
        gated = F.silu(gate) * up
    h = _int4(gated, w[8], w[9], w[17], down_planes, down_kernel, group, not post_ffn, none, 0.0)
    if post_ffn:
        h = _widen(h, x.dtype)
        h = F.rms_norm(h, [h.shape[-1]], w[13], eps)
    return x + h


def _attention(y: torch.Tensor, w: List[torch.Tensor], n: List[int], eps: float, scale: float,
               cos: torch.Tensor, sin: torch.Tensor, datas: List[torch.Tensor], layer: int,
               starts: List[int], firsts: List[int], seens: List[int],
               per_head_from: int) -> torch.Tensor:
    """The attention of `decode_layer` through torch's operations: y [1, N, H + 2 Hkv, D]
    the QKV product -> [N, H * D] in the KV copies' dtype."""
    H, Hkv, D = n[0], n[1], n[2]
    has_qk_norm = n[7] != 0
    N = y.shape[1]
    parts = y.split_with_sizes([H + Hkv, Hkv], 2)
    qk, v = parts[0], parts[1]
    if has_qk_norm:  # (y is float32 here: a product that does not promote returns x's dtype)
        qk = F.rms_norm(qk, [D], None, eps) * w[11]
    qk = torch.addcmul(qk * cos, qk.index_select(-1, w[10]), sin)
    parts = qk.split_with_sizes([H, Hkv], 2)
    q, k, v = parts[0], parts[1].transpose(1, 2), v.transpose(1, 2)  # q [1, N, H, D]; k, v [1, Hkv, N, D]
    kv_dtype = datas[0].dtype
    if q.dtype != kv_dtype:
        q = q.to(kv_dtype)
    # Per sequence, what `DecoderLayer._attend` hands SDPA, made with as few operations as
    # possible (each is paid per sequence and layer): its query [1, Hkv, H / Hkv, D] (the
    # same strides as its reshape gives), the keys and values it sees [1, Hkv, seens[i], D]
    # (views of the copy, as the KV view's), and its output [1, Hkv, H / Hkv, D] in the
    # cache's dtype.
    if N == 1:  # (keys and values written by a copy each: no joined copy of the two)
        both = datas[0][layer]  # [2, Hkv, capacity, D]
        slot = both.narrow(2, starts[0], 1)
        slot[0].copy_(k[0])
        slot[1].copy_(v[0])
        seen = both.narrow(2, firsts[0], seens[0]).split(1)
        out = _attend(q.view(1, Hkv, H // Hkv, D), seen[0], seen[1], seens[0], per_head_from,
                      H > Hkv, scale).view(1, H * D)
    else:
        queries = q.reshape(N, Hkv, H // Hkv, D).split(1)
        news = torch.cat((k, v)).split(1, 2)  # [2, Hkv, 1, D] each: one copy writes both
        outs: List[torch.Tensor] = []
        for i in range(N):
            both = datas[i][layer]
            both.narrow(2, starts[i], 1).copy_(news[i])
            seen = both.narrow(2, firsts[i], seens[i]).split(1)
            outs.append(_attend(queries[i], seen[0], seen[1], seens[i], per_head_from, H > Hkv,
                                scale))
        # [N, Hkv, H / Hkv, D] is [N, H * D] in the order the packed row's output has.
        out = torch.cat(outs).view(N, H * D)
    return out


def decode_layers(x: torch.Tensor, ws: List[List[torch.Tensor]], ns: List[List[int]], eps: float,
                  scale: float, coss: List[torch.Tensor], sins: List[torch.Tensor],
                  datas: List[torch.Tensor], starts: List[int], firsts: List[List[int]],
                  seens: List[List[int]], per_head_from: int, attns: List[torch.Tensor],
                  attn_ints: List[int]) -> torch.Tensor:
    """Every layer in turn (layer i: ws[i], ns[i], its RoPE tables, its window's slices and
    attns[i]): one call a pass instead of one a layer (~0.5 ms less a SmolLM2 step)."""
    for i in range(len(ws)):
        x = decode_layer(x, ws[i], ns[i], eps, scale, coss[i], sins[i], datas, i, starts,
                         firsts[i], seens[i], per_head_from, attns[i], attn_ints)
    return x


def run(layers, x: torch.Tensor, tables: dict, kv, per_head_from: int | None = None
        ) -> Optional[torch.Tensor]:
    """The decoder layers' output for x [N, d] in a pass of decode steps alone, scripted, or
    None where this pass or a layer is outside the scope (the caller runs the layers then).
    `tables` maps each layer's RoPE spec to its (cos, sin); `kv` is the pass's KV view;
    `per_head_from` the model's (`TransformerLM.per_head_from`)."""
    args = [layer._decode_args for layer in layers]
    if any(a is None for a in args) or x.dtype != torch.float32 \
            or x.shape[0] > min(a.rows_max for a in args):
        return None
    plan_of = getattr(kv, "decode_plan", None)
    plans = {}
    for layer in layers:
        if layer.window not in plans:
            plans[layer.window] = plan_of(layer.window) if plan_of is not None else None
            if plans[layer.window] is None:
                return None
    blocks = [layer._block for layer in layers]
    whole = all(b is not None for b in blocks)  # every layer one compiled call: no TorchScript
    step = compiled()
    if step is None and not whole:
        return None
    datas, starts = next(iter(plans.values()))[:2]
    attns, attn_ints = [_NO_TABLE] * len(layers), [0, 1, 1]
    if any(layer._fused_attention for layer in layers):
        if datas[0].dtype not in KV_KINDS:
            return None  # (the layers attend with SDPA then, `DecoderLayer._attend_decode`)
        H, Hkv, D = args[0].ints[:3]
        for window, plan in plans.items():
            at = [i for i, layer in enumerate(layers) if layer.window == window]
            seqs = decode_attention.plan(*plan, at, H, Hkv, D)
            for i, table in zip(at, seqs.tables):
                attns[i] = table
            attn_ints = [seqs.kind, max(attn_ints[1], seqs.longest), max(attn_ints[2], seqs.threads)]
    if whole:  # (the layers' own call, `DecoderLayer._decode_block`, layer after layer)
        N, D = x.shape[0], args[0].ints[2]
        flat = {spec: (cos.reshape(N, D), sin.reshape(N, D)) for spec, (cos, sin) in tables.items()}
        return decode_block.layers(x, blocks, [flat[layer.rope][0] for layer in layers],
                                   [flat[layer.rope][1] for layer in layers], attns, *attn_ints)
    if step is None:
        return None
    return step(x, [a.tensors for a in args], [a.ints for a in args], args[0].eps, args[0].scale,
                [tables[layer.rope][0] for layer in layers], [tables[layer.rope][1] for layer in layers],
                datas, starts, [plans[layer.window][2] for layer in layers],
                [plans[layer.window][3] for layer in layers],
                -1 if per_head_from is None else per_head_from, attns, attn_ints)


def compiled_layers(model) -> bool:
    """Whether `model`'s decode passes run every layer as one compiled call
    (`decode_block`), a path of their own (not torch's operations bit for bit)."""
    layers = getattr(model, "layers", None)
    return bool(layers) and all(getattr(layer, "_block", None) is not None for layer in layers)


def mode(model) -> str:
    """How `model`'s decode passes run: "compiled layers" (every layer one compiled call,
    `decode_block`, layer after layer), "TorchScript" (every layer in scope and the step
    compiled), "Python" (a layer outside the scope: float weights, ...) or "Python
    (TorchScript unavailable)". For the status bar's tooltip, `bench` and the frozen
    self-test (which fails on the last form: the scripted step's source was not shipped)."""
    if compiled() is None:
        return "Python (TorchScript unavailable)"
    if compiled_layers(model):
        return "compiled layers"
    layers = getattr(model, "layers", None)
    if layers and all(getattr(layer, "_decode_args", None) is not None for layer in layers):
        return "TorchScript"
    return "Python"


def _int4(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, offsets: torch.Tensor,
          planes: int, kernel: int, group: int, promotes: bool, norm: torch.Tensor,
          eps: float) -> torch.Tensor:
    """`quantized.int4_linear` on 2-D x (its scales are in its activation dtype); `kernel`
    as `DecodeArgs.ints` says (-1: torch's 4-bit kernel, else an `Int8Codes` layout, whose
    codes, scales and offsets are `packed`, `scale_zeros` and `offsets`, and which takes x's
    pre-norm `norm` (empty: none) into its product)."""
    if kernel >= 0:
        out = torch.ops.ferrox.int8_matmul(x, packed, scale_zeros, offsets, kernel, planes, norm, eps)
        if not promotes and out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out
    a = x if x.dtype == scale_zeros.dtype else x.to(scale_zeros.dtype)
    if planes > 1:
        a = torch.cat([a] * planes, dim=-1)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, group, scale_zeros)
    if not promotes and out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: int,
            per_head_from: int, grouped: bool, scale: float) -> torch.Tensor:
    """One sequence's decode attention, as `DecoderLayer._attend` asks it: q [1, Hkv, G, D]
    (the G query heads sharing a KV head as rows; `grouped`: G > 1) over its `seen` keys and
    values [1, Hkv, seen, D] -> [1, Hkv, G, D]; per query head (`enable_gqa`) from
    `per_head_from` keys (-1: never). Scripted calls are inlined, and the per-KV-head path
    runs the one SDPA call it always did."""
    if grouped and 0 <= per_head_from <= seen:
        return F.scaled_dot_product_attention(q.flatten(1, 2).unsqueeze(2), keys, values,
                                              scale=scale, enable_gqa=True).view_as(q)
    return F.scaled_dot_product_attention(q, keys, values, scale=scale)


def _widen(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`linear_from`'s last step without `promotes`: the result in the activations' dtype."""
    return h if h.dtype == dtype else h.to(dtype)


def prepare(layer) -> DecodeArgs | None:
    """The constant arguments of `layer` (a `DecoderLayer` whose products are joined), or
    None when it is outside this function's scope (the module docstring)."""
    from app.models.int8_products import Int8Codes
    from app.models.layers import ROPE_HALF, _pair_swap
    from app.models.quantized import INT4_GROUP, QuantizedWeight

    c = layer.cfg
    qkv, o, gate_up, down = layer.qkv, layer.o, layer.gate_up, layer.down
    products = (qkv, o, gate_up, down)
    if not all(isinstance(p, QuantizedWeight) and p.exact_top == 0 and p.device.type == "cpu"
               and (p.codes.codes.is_contiguous() if isinstance(p.codes, Int8Codes)
                    else p.codes.scale_zeros.dtype == p.act_dtype and p.codes.scale_zeros.is_contiguous())
               for p in products):
        return None
    of = layer._qkv_of
    if not (of and of[0] is layer.q and of[1] is layer.k and of[2] is layer.v and layer.v is not None
            and of[3] is None and layer.q_bias is None and layer.qkv_bias is None):
        return None  # Q, K and V not in one product, or with a bias
    if not (layer._gate_up_of and layer._gate_up_of[0] is layer.gate and layer._gate_up_of[1] is layer.up):
        return None
    qk_norm = layer.qk_norm
    if (layer.q_norm is None) != (layer.k_norm is None) or (
            layer.q_norm is not None and not (layer._qk_norm_of and layer._qk_norm_of[0] is layer.q_norm
                                              and layer._qk_norm_of[1] is layer.k_norm)):
        return None
    norms = [t for t in (layer.attn_norm, layer.ffn_norm, layer.post_attn_norm, layer.post_ffn_norm, qk_norm)
             if t is not None]
    if any(t.dtype != torch.float32 for t in norms):
        return None
    spec = layer.rope
    if spec.rotary_dim != c.head_dim or c.attn_softcap is not None:
        return None
    if c.activation not in ("silu", "gelu_tanh"):
        return None
    D = c.head_dim
    if spec.style == ROPE_HALF:  # rotate-half's swap: (i, i + D/2), as `roll` does
        swap = torch.arange(D).roll(D // 2)
    else:  # interleaved pairs (2i, 2i + 1): the order `rotate` gathers by
        swap = _pair_swap(D, qkv.device)
    empty = torch.empty(0)

    def parts(p) -> tuple:  # (packed or codes, scales, offsets or empty, kernel)
        if isinstance(p.codes, Int8Codes):
            return p.codes.codes, p.codes.scales, p.codes.offsets, p.codes.layout
        return p.codes.packed, p.codes.scale_zeros, empty, -1

    qkv_t, o_t, gate_up_t, down_t = (parts(p) for p in products)
    tensors = [layer.attn_norm, qkv_t[0], qkv_t[1], o_t[0], o_t[1], layer.ffn_norm,
               gate_up_t[0], gate_up_t[1], down_t[0], down_t[1], swap,
               qk_norm if qk_norm is not None else empty,
               layer.post_attn_norm if layer.post_attn_norm is not None else empty,
               layer.post_ffn_norm if layer.post_ffn_norm is not None else empty,
               qkv_t[2], o_t[2], gate_up_t[2], down_t[2], empty,
               layer._block if layer._block is not None else empty]
    ints = [c.n_heads, c.n_kv_heads, D, qkv.codes.planes, o.codes.planes, gate_up.codes.planes,
            down.codes.planes, int(qk_norm is not None), int(layer.post_attn_norm is not None),
            int(layer.post_ffn_norm is not None), int(c.activation == "gelu_tanh"), INT4_GROUP,
            qkv_t[3], o_t[3], gate_up_t[3], down_t[3], int(layer._fused_attention),
            int(spec.style == ROPE_HALF), int(layer._norms_in_products), int(layer._block is not None)]
    rows_max = min(p.narrow_rows_max if p.wide is not None else 1 << 30 for p in products)
    return DecodeArgs(tensors, ints, c.rms_eps, c.attention_scale, rows_max)


_NO_TABLE = torch.empty(0, dtype=torch.int64)  # a layer attending through torch's operations

_compiled = None
_compile_tried = False
_compile_lock = threading.Lock()


def compiled():
    """`decode_layers` scripted (once a process), or None where TorchScript cannot (no
    source files, a torch without it)."""
    global _compiled, _compile_tried
    if _compile_tried:
        return _compiled
    with _compile_lock:
        if not _compile_tried:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "torch.jit.script is deprecated"
                    _compiled = torch.jit.script(decode_layers)
            except Exception as exc:  # noqa: BLE001 - any failure: the Python path
                log.info("The scripted decode step is not available (%s); layers run in Python.", exc)
                _compiled = None
            _compile_tried = True
    return _compiled
