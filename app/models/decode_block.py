"""A decode pass's whole decoder layer in one compiled call: the norm and QKV product, the
attention (`app.models.decode_attention`), the output product, the residual adds, the norm
and gate-up product, the activation and the down product, compiled with the 8-bit activation
kernel (`app.models.int8_products`: the same LLVM module, threads and cache).

Why: with its products and attention compiled, a small model's decode step was still ~40%
other work on a 2-core AMD EPYC (SmolLM2 135M, 110 tok/s against llama.cpp's 151): each
product reached its kernel through the dispatcher, a Python function and ctypes (~8 us a
call, 120 a step), and between them TorchScript ran ~10 small operations a layer (the
residual adds, the chunk, SiLU and the gating multiply, ...), a few microseconds each. Here
a layer is one call: its four products, its attention and the glue between them run back
to back on torch's OpenMP threads.

The arithmetic is the layer's (`DecoderLayer.forward`), with the products and attention as
their kernels compute them; the glue, per row of x:
    post-norms (Gemma 3's sandwich): y * 1 / sqrt(mean(y^2) + eps) * w, the squares summed
        in 4 accumulators of 8 lanes, then a fixed tree
    residual adds: x + y, exactly as torch adds
    SiLU: g / (1 + exp(-g)); tanh-GELU: g / 2 * (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
        tanh(u) = 1 - 2 / (exp(2u) + 1); exp is the attention's Cephes polynomial, its input
        held within [-87, 88]
so the glue is float32 within a few units in the last place of torch's operations, not bit
for bit. Both of a decode pass's paths call it (the scripted step, `decode_step`, and the
layers' Python, `DecoderLayer.forward`), so they stay bitwise equal; every row is computed
in one fixed order whatever else is in the pass, so batching changes no bit.

It serves layers whose four products multiply 8-bit activations, whose attention is the
compiled one, and whose pre-norms are computed in their products (`serves`); a pass with a
prompt chunk in it runs the layers' operations as before.
"""

from __future__ import annotations

import ctypes
import math
import struct

import torch

from app.models import decode_attention, int8_products

# The layer's constants (`constants`), int64 a field, in this order; pointers are addresses,
# floats their float32 bits; an absent norm is 0.
_PRODUCTS = ("qkv", "o", "gate_up", "down")
_PRODUCT_FIELDS = ("codes", "s", "b", "planes", "layout")
CONSTANT_FIELDS = ("attn_norm", "ffn_norm", "qk_norm", "post_attn_norm", "post_ffn_norm",
                   *(f"{p}_{f}" for p in _PRODUCTS for f in _PRODUCT_FIELDS),
                   "gelu", "H", "Hkv", "D", "d", "F", "half", "eps", "scale")
_FLOAT_FIELDS = {"eps", "scale"}
_DIMS = slice(CONSTANT_FIELDS.index("H"), CONSTANT_FIELDS.index("F") + 1)  # H, Hkv, D, d, F
_POINTER_FIELDS = {"attn_norm", "ffn_norm", "qk_norm", "post_attn_norm", "post_ffn_norm",
                   *(f"{p}_{f}" for p in _PRODUCTS for f in ("codes", "s", "b"))}
# A call's own values (`block`), int64 a field, in this order.
CALL_FIELDS = ("x", "out", "N", "cos", "sin", "table", "kind", "cmax", "attn_threads", "threads",
               "mscratch", "qbuf", "tmp", "sbufs", "obufs", "mbufs", "lbufs",
               "y_qkv", "y_attn", "y_d", "y_gate_up", "y_gated")

_DECLARE = """
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare <8 x float> @llvm.minnum.v8f32(<8 x float>, <8 x float>)
declare float @llvm.sqrt.f32(float)
"""


def _norm_ir() -> str:
    """block_norm(y, w, eps, N, d): each row of y [N, d] times 1 / sqrt(mean(y^2) + eps),
    times w [d], in place."""
    L = ["define internal void @block_norm(ptr %y, ptr %w, float %eps, i64 %N, i64 %d) {",
         "entry:",
         "  %nc = lshr i64 %d, 5",  # blocks of 32: four vectors of 8
         "  %df = uitofp i64 %d to float",
         "  br label %row",
         "row:", "  %r = phi i64 [0, %entry], [%rn, %scaled]",
         "  %ro = mul i64 %r, %d",
         "  %yr = getelementptr float, ptr %y, i64 %ro"]
    L += int8_products.inverse_rms_ir("%yr", "%nc", "%df", "%eps", "row", "sq")
    L += ["  %n8 = lshr i64 %d, 3",
          "  br label %scale",
          "scale:", "  %j = phi i64 [0, %sq_done], [%jn, %scale]",
          "  %jo = shl i64 %j, 3",
          "  %yp = getelementptr float, ptr %yr, i64 %jo",
          "  %yv = load <8 x float>, ptr %yp, align 4",
          "  %wp = getelementptr float, ptr %w, i64 %jo",
          "  %wv = load <8 x float>, ptr %wp, align 4",
          "  %yn = fmul <8 x float> %yv, %sq_iv",
          "  %yw = fmul <8 x float> %yn, %wv",
          "  store <8 x float> %yw, ptr %yp, align 4",
          "  %jn = add i64 %j, 1", "  %jmore = icmp ult i64 %jn, %n8",
          "  br i1 %jmore, label %scale, label %scaled",
          "scaled:",
          "  %rn = add i64 %r, 1", "  %rmore = icmp ult i64 %rn, %N",
          "  br i1 %rmore, label %row, label %done",
          "done:", "  ret void", "}"]
    return "\n".join(L)


def _add_ir() -> str:
    """block_add(out, x, y, n): out = x + y over n floats (n a multiple of 8; out may be x)."""
    return "\n".join([
        "define internal void @block_add(ptr %out, ptr %x, ptr %y, i64 %n) {",
        "entry:", "  %n8 = lshr i64 %n, 3", "  br label %l",
        "l:", "  %i = phi i64 [0, %entry], [%in, %l]",
        "  %o = shl i64 %i, 3",
        "  %xp = getelementptr float, ptr %x, i64 %o", "  %xv = load <8 x float>, ptr %xp, align 4",
        "  %yp = getelementptr float, ptr %y, i64 %o", "  %yv = load <8 x float>, ptr %yp, align 4",
        "  %s = fadd <8 x float> %xv, %yv",
        "  %op = getelementptr float, ptr %out, i64 %o", "  store <8 x float> %s, ptr %op, align 4",
        "  %in = add i64 %i, 1", "  %more = icmp ult i64 %in, %n8",
        "  br i1 %more, label %l, label %done",
        "done:", "  ret void", "}"])


def _act_ir() -> str:
    """block_act(gu, out, N, F, gelu): out[r, i] = act(gu[r, i]) * gu[r, F + i] for gu
    [N, 2F] (gate, then up), out [N, F]; act SiLU or, with `gelu`, tanh-GELU."""
    c = math.sqrt(2.0 / math.pi)
    splat = decode_attention._splat
    return "\n".join([
        "define internal void @block_act(ptr %gu, ptr %out, i64 %N, i64 %F, i64 %gelu) {",
        "entry:",
        "  %F8 = lshr i64 %F, 3",
        "  %isgelu = icmp ne i64 %gelu, 0",
        "  %F2 = shl i64 %F, 1",
        "  br label %row",
        "row:", "  %r = phi i64 [0, %entry], [%rn, %row_end]",
        "  %go = mul i64 %r, %F2",
        "  %gr = getelementptr float, ptr %gu, i64 %go",
        "  %ur = getelementptr float, ptr %gr, i64 %F",
        "  %oo = mul i64 %r, %F",
        "  %or = getelementptr float, ptr %out, i64 %oo",
        "  br label %l",
        "l:", "  %i = phi i64 [0, %row], [%in, %act_done]",
        "  %o = shl i64 %i, 3",
        "  %gp = getelementptr float, ptr %gr, i64 %o", "  %g = load <8 x float>, ptr %gp, align 4",
        "  %up = getelementptr float, ptr %ur, i64 %o", "  %u = load <8 x float>, ptr %up, align 4",
        "  br i1 %isgelu, label %gelu_l, label %silu_l",
        "silu_l:",
        "  %ng = fneg <8 x float> %g",
        f"  %ngc = call <8 x float> @llvm.minnum.v8f32(<8 x float> %ng, <8 x float> {splat(88.0)})",
        "  %e = call <8 x float> @attn_exp8(<8 x float> %ngc)",
        f"  %den = fadd <8 x float> %e, {splat(1.0)}",
        "  %silu = fdiv <8 x float> %g, %den",
        "  br label %act_done",
        "gelu_l:",
        "  %g2 = fmul <8 x float> %g, %g",
        "  %g3 = fmul <8 x float> %g2, %g",
        f"  %inner = call <8 x float> @llvm.fma.v8f32(<8 x float> %g3, <8 x float> {splat(0.044715)}, <8 x float> %g)",
        f"  %t2 = fmul <8 x float> %inner, {splat(2.0 * c)}",
        f"  %t2c = call <8 x float> @llvm.minnum.v8f32(<8 x float> %t2, <8 x float> {splat(88.0)})",
        "  %e2 = call <8 x float> @attn_exp8(<8 x float> %t2c)",
        f"  %e2p = fadd <8 x float> %e2, {splat(1.0)}",
        f"  %q = fdiv <8 x float> {splat(2.0)}, %e2p",
        f"  %tanh = fsub <8 x float> {splat(1.0)}, %q",
        f"  %onep = fadd <8 x float> %tanh, {splat(1.0)}",
        f"  %hg = fmul <8 x float> %g, {splat(0.5)}",
        "  %gl = fmul <8 x float> %hg, %onep",
        "  br label %act_done",
        "act_done:",
        "  %a = phi <8 x float> [%silu, %silu_l], [%gl, %gelu_l]",
        "  %y = fmul <8 x float> %a, %u",
        "  %op = getelementptr float, ptr %or, i64 %o", "  store <8 x float> %y, ptr %op, align 4",
        "  %in = add i64 %i, 1", "  %more = icmp ult i64 %in, %F8",
        "  br i1 %more, label %l, label %row_end",
        "row_end:",
        "  %rn = add i64 %r, 1", "  %rmore = icmp ult i64 %rn, %N",
        "  br i1 %rmore, label %row, label %done",
        "done:", "  ret void", "}"])


def _block_ir() -> str:
    """block(constants, call): one layer of a decode pass (the module docstring)."""
    L = ["define void @block(ptr %c, ptr %v) {", "entry:"]

    def field(base: str, names: tuple, name: str, ty: str) -> None:
        i = names.index(name)
        L.append(f"  %{name}_a = getelementptr i64, ptr {base}, i64 {i}")
        if ty == "ptr":
            L.append(f"  %{name} = load ptr, ptr %{name}_a, align 8")
        elif ty == "float":
            L.append(f"  %{name} = load float, ptr %{name}_a, align 8")  # the low 32 bits
        else:
            L.append(f"  %{name} = load i64, ptr %{name}_a, align 8")

    for name in CONSTANT_FIELDS:
        field("%c", CONSTANT_FIELDS, name,
              "ptr" if name in _POINTER_FIELDS else "float" if name in _FLOAT_FIELDS else "i64")
    for name in CALL_FIELDS:
        field("%v", CALL_FIELDS, name, "i64" if name in ("N", "kind", "cmax", "attn_threads", "threads")
              else "ptr")
    L += ["  %th = trunc i64 %threads to i32",
          "  %ath = trunc i64 %attn_threads to i32",
          "  %nb_d = lshr i64 %d, 5",
          "  %HD = mul i64 %H, %D",
          "  %nb_a = lshr i64 %HD, 5",
          "  %nb_f = lshr i64 %F, 5",
          "  %Hkv2 = shl i64 %Hkv, 1",
          "  %Hall = add i64 %H, %Hkv2",
          "  %Nqkv = mul i64 %Hall, %D",
          "  %F2 = shl i64 %F, 1",
          "  %Nd = mul i64 %N, %d",
          "  %has_qkn = zext i1 %qkn_on to i64",
          # attention: QKV product on x's norm, then the compiled attention
          "  call void @matmul(ptr %x, i64 0, ptr %attn_norm, float %eps, ptr %qkv_codes, ptr %qkv_s, "
          "ptr %qkv_b, ptr %mscratch, ptr %y_qkv, i64 %N, i64 %Nqkv, i64 %nb_d, i64 %qkv_planes, "
          "i64 %qkv_layout, i32 %th)",
          "  call void @attend(ptr %y_qkv, ptr %cos, ptr %sin, ptr %qk_norm, i64 %has_qkn, float %eps, "
          "ptr %table, i64 %N, i64 %H, i64 %Hkv, i64 %D, i64 %half, i64 %kind, float %scale, "
          "ptr %qbuf, ptr %tmp, ptr %sbufs, i64 %cmax, ptr %obufs, ptr %mbufs, ptr %lbufs, "
          "ptr %y_attn, i32 %ath)",
          "  call void @matmul(ptr %y_attn, i64 0, ptr null, float 0.0, ptr %o_codes, ptr %o_s, "
          "ptr %o_b, ptr %mscratch, ptr %y_d, i64 %N, i64 %d, i64 %nb_a, i64 %o_planes, "
          "i64 %o_layout, i32 %th)",
          "  %pa = icmp ne ptr %post_attn_norm, null",
          "  br i1 %pa, label %pa_norm, label %pa_done",
          "pa_norm:",
          "  call void @block_norm(ptr %y_d, ptr %post_attn_norm, float %eps, i64 %N, i64 %d)",
          "  br label %pa_done",
          "pa_done:",
          "  call void @block_add(ptr %out, ptr %x, ptr %y_d, i64 %Nd)",
          # MLP: gate-up product on the new x's norm, the activation, the down product
          "  call void @matmul(ptr %out, i64 0, ptr %ffn_norm, float %eps, ptr %gate_up_codes, "
          "ptr %gate_up_s, ptr %gate_up_b, ptr %mscratch, ptr %y_gate_up, i64 %N, i64 %F2, "
          "i64 %nb_d, i64 %gate_up_planes, i64 %gate_up_layout, i32 %th)",
          "  call void @block_act(ptr %y_gate_up, ptr %y_gated, i64 %N, i64 %F, i64 %gelu)",
          "  call void @matmul(ptr %y_gated, i64 0, ptr null, float 0.0, ptr %down_codes, ptr %down_s, "
          "ptr %down_b, ptr %mscratch, ptr %y_d, i64 %N, i64 %d, i64 %nb_f, i64 %down_planes, "
          "i64 %down_layout, i32 %th)",
          "  %pf = icmp ne ptr %post_ffn_norm, null",
          "  br i1 %pf, label %pf_norm, label %pf_done",
          "pf_norm:",
          "  call void @block_norm(ptr %y_d, ptr %post_ffn_norm, float %eps, i64 %N, i64 %d)",
          "  br label %pf_done",
          "pf_done:",
          "  call void @block_add(ptr %out, ptr %out, ptr %y_d, i64 %Nd)",
          "  ret void", "}"]
    # (has_qkn from the pointer)
    at = L.index("  %has_qkn = zext i1 %qkn_on to i64")
    L.insert(at, "  %qkn_on = icmp ne ptr %qk_norm, null")
    return "\n".join(L)


def block_ir(declared: str) -> str:
    """This kernel's part of the module; `declared` is the rest of it (its declarations,
    `@matmul` and `@attend` among them)."""
    header = "\n".join(line for line in _DECLARE.strip().splitlines()
                       if line.split("(")[0] + "(" not in declared)
    return "\n".join([header, _norm_ir(), _add_ir(), _act_ir(), _block_ir()])


# ---- calling it -------------------------------------------------------------------------------


def serves(layer) -> bool:
    """Whether `layer`'s decode passes run here: its attention is the compiled one
    (`decode_attention.serves`), its four products multiply 8-bit activations on weights
    stored as `Int8Codes`, its pre-norms are computed in them, its widths are whole pairs
    of blocks, and its activation is SiLU or tanh-GELU."""
    from app.models.quantized import QuantizedWeight

    c = layer.cfg
    products = (layer.qkv, layer.o, layer.gate_up, layer.down)
    return bool(layer._fused_attention and layer._norms_in_products
                and all(isinstance(p, QuantizedWeight) and isinstance(p.codes, int8_products.Int8Codes)
                        and p.codes.codes.is_contiguous() and not p.exact_top and p.device.type == "cpu"
                        for p in products)
                and c.activation in ("silu", "gelu_tanh")
                and int8_products.fits(c.d_model) and int8_products.fits(c.ffn_dim)
                and int8_products.fits(c.n_heads * c.head_dim)
                and all(t is None or (t.dtype == torch.float32 and t.is_contiguous())
                        for t in (layer.attn_norm, layer.ffn_norm, layer.qk_norm,
                                  layer.post_attn_norm, layer.post_ffn_norm)))


def constants(layer) -> torch.Tensor:
    """The layer's constants for `block` (CONSTANT_FIELDS), int64. It holds the addresses of
    the layer's weights: whoever keeps it keeps those tensors too (`decode_step.DecodeArgs`)."""
    from app.models.layers import ROPE_HALF

    c = layer.cfg
    values: dict[str, int] = {}
    for name in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm"):
        t = getattr(layer, name)
        values[name] = t.data_ptr() if t is not None else 0
    values["qk_norm"] = layer.qk_norm.data_ptr() if layer.q_norm is not None else 0
    for p in _PRODUCTS:
        codes = getattr(layer, p).codes
        values |= {f"{p}_codes": codes.codes.data_ptr(), f"{p}_s": codes.scales.data_ptr(),
                   f"{p}_b": codes.offsets.data_ptr(), f"{p}_planes": codes.planes,
                   f"{p}_layout": codes.layout}
    values |= {"gelu": int(c.activation == "gelu_tanh"), "H": c.n_heads, "Hkv": c.n_kv_heads,
               "D": c.head_dim, "d": c.d_model, "F": c.ffn_dim,
               "half": int(layer.rope.style == ROPE_HALF)}
    for name, value in (("eps", c.rms_eps), ("scale", c.attention_scale)):
        values[name] = struct.unpack("<I", struct.pack("<f", value))[0]
    return torch.tensor([values[name] for name in CONSTANT_FIELDS], dtype=torch.int64)


def block(x: torch.Tensor, consts: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          table: torch.Tensor, kind: int, longest: int, attn_threads: int) -> torch.Tensor:
    """x [N, d] float32, the residual stream of a decode pass (one row a sequence) -> the
    layer's output [N, d]; consts: `constants(layer)`; cos, sin [N, D]; table, kind,
    longest, attn_threads: the layer's of a `decode_attention.Plan` (as `attend` takes them)."""
    return layers(x, [consts], [cos], [sin], [table], kind, longest, attn_threads)


def layers(x: torch.Tensor, consts: list[torch.Tensor], coss: list[torch.Tensor],
           sins: list[torch.Tensor], tables: list[torch.Tensor], kind: int, longest: int,
           attn_threads: int) -> torch.Tensor:
    """`block` for several layers in turn (layer i: consts[i], coss[i], sins[i], tables[i]),
    checked and laid out once: the same kernel on the same values, so the same bits as a
    call a layer (the scripted step's or the layers' Python), without a dispatch a layer."""
    k = int8_products.kernel()
    if k is None:
        raise RuntimeError(f"The compiled kernels are not available: {int8_products.unavailable_reason()}")
    if not (consts and len(consts) == len(coss) == len(sins) == len(tables)):
        raise ValueError("decode_block: constants, cos, sin and a table a layer")
    dims = None
    for c in consts:
        if not (c.dtype == torch.int64 and c.numel() == len(CONSTANT_FIELDS) and c.is_contiguous()):
            raise ValueError("decode_block: constants from `decode_block.constants`")
        these = c[_DIMS].tolist()
        if dims is not None and these != dims:
            raise ValueError("decode_block: layers of different shapes")
        dims = these
    H, Hkv, D, d, F = dims
    N = x.shape[0]
    if not (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == d):
        raise ValueError(f"decode_block: x must be float32 [N, {d}]")
    if not x.is_contiguous():
        x = x.contiguous()
    for cos, sin, table in zip(coss, sins, tables):
        if not (cos.dtype == sin.dtype == torch.float32 and cos.numel() == sin.numel() == N * D
                and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("decode_block: cos and sin must be float32 [N, D]")
        if not (table.dtype == torch.int64 and table.is_contiguous() and table.shape == (N, 7)):
            raise ValueError("decode_block: a table [N, 7] from `decode_attention.plan`")
    if not (kind in decode_attention._KIND_NAMES and longest >= 1 and attn_threads >= 1):
        raise ValueError("decode_block: the kind, longest and threads of a `decode_attention.Plan`")
    cmax, attention = decode_attention.buffer_floats(N, H, Hkv, D, longest, attn_threads)
    sizes = [  # bytes of each buffer, in CALL_FIELDS order after "threads"
        int8_products._scratch_bytes(N, max(d, H * D, F)),  # the products' 8-bit x
        *(4 * floats for floats in attention),  # the attention's (`decode_attention.attend`)
        4 * N * (H + 2 * Hkv) * D, 4 * N * H * D, 4 * N * d, 8 * N * F, 4 * N * F]  # y_qkv .. y_gated
    at, total = [], 0
    for size in sizes:
        at.append(total)
        total += (size + 63) // 64 * 64  # each buffer on its own cache lines
    # (the products' and the attention's scratch: free while the kernel runs, which calls
    # neither from Python)
    base = int8_products._scratch(total).data_ptr()
    outs = [torch.empty(N, d, dtype=torch.float32) for _ in range(min(2, len(consts)))]
    call = (ctypes.c_int64 * len(CALL_FIELDS))(
        0, 0, N, 0, 0, 0, kind, cmax, attn_threads, torch.get_num_threads(), *(base + a for a in at))
    inp = x
    for i, (c, cos, sin, table) in enumerate(zip(consts, coss, sins, tables)):
        out = outs[i % len(outs)]  # (in and out alternate: a layer never writes its input)
        call[0], call[1], call[3], call[4], call[5] = (inp.data_ptr(), out.data_ptr(), cos.data_ptr(),
                                                       sin.data_ptr(), table.data_ptr())
        k.block(c.data_ptr(), ctypes.addressof(call))
        inp = out
    return inp


# The call as a torch operator, for TorchScript (`app.models.decode_step`).
_LIBRARY = torch.library.Library("ferrox", "FRAGMENT")
_LIBRARY.define("decode_block(Tensor x, Tensor consts, Tensor cos, Tensor sin, Tensor table, "
                "int kind, int longest, int attn_threads) -> Tensor")
_LIBRARY.impl("decode_block", block, "CPU")
