"""A decode step's attention in one call: QK-norm, RoPE, the new key and value written into
each sequence's KV copy, and every query head's attention over its keys, for every sequence
of the pass, compiled with the 8-bit activation kernel (`app.models.int8_products`, the same
LLVM module, threads and cache).

Why: in a decode step of a small model the attention's own arithmetic is tiny (SmolLM2:
9 query heads of 64 over a few hundred keys), but around it torch runs ~15 small operations
a layer and sequence (the RoPE gather and multiply-add, two cache writes, views, the
queries' conversion, SDPA), each a dispatch of a few microseconds. Measured on a 2-core Xeon
with torch's AVX2 kernels, SmolLM2: the step without the block ran ~68 us a layer faster for
one sequence and ~190 us for four (docs/performance.md); this call does it in one dispatch
whatever the number of sequences, and over 4,000 keys it is faster than SDPA alone (SmolLM2's
heads 162 against 222 us, Gemma 3's 220 against 268).

The arithmetic, per sequence i and query head h (KV head h // (H / Hkv)):
    q, k   = the product's row (QK-norm: x * 1 / sqrt(mean(x^2) + eps) * weight per head)
             rotated: y_j = x_j * cos_j + x_partner(j) * sin_j (sin signed, as
             `RopeSpec.rotation` gives it; partner j + D/2 mod D, or j ^ 1 interleaved)
    k, v   -> the copy's slot `start` (float32, or bfloat16 rounded to nearest even)
    s_t    = (q * scale) . k_t over the `seen` positions from `first`
    out    = sum_t exp(s_t - max s) v_t / sum_t exp(s_t - max s)     (float32 throughout)
The keys are taken in parts of PART_KEYS, each part of each KV head a work item on torch's
OpenMP threads that serves all the query heads sharing that KV head (each key and value is
loaded and widened once for them), and the parts are merged in order after (`_merge_ir`:
out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, flash-decoding's split). The parts
depend on a sequence's own length only, and each is computed in one fixed order on whichever
thread: batching and thread counts change no bit (tests/models/test_decode_attention.py
holds this, and the result to a float64 reference). A part asks for the keys and values
PREFETCH_KEYS positions ahead of those it multiplies: between two steps a decode step's
weights pass through the caches, so the KV copies come from memory every step, and asking
ahead measured faster than leaving it to the hardware's prefetchers (2-core AMD EPYC,
bfloat16 copies, in the engine: one stream after a 1,000-token prompt, SmolLM2 164-173 ->
182-186 tok/s, Gemma 3 270M 108-111 -> 117-122). exp is Cephes' expf polynomial (`_EXP`),
not libm's, so the machine code needs no symbol beyond OpenMP's.

It serves decode passes only (one new token a sequence, the KV view's `decode_plan`), in the
scripted step and the layers' Python alike (`DecoderLayer.attention`), so the two stay
bitwise equal. A pass with a prompt chunk in it attends with SDPA as before.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from app.models import int8_products  # (defines the ferrox operator library first)

# KV copy dtypes the kernel reads and writes, by the code its IR switches on: the CPU
# policy's two (each dtype is 8 more functions to compile; a float16 copy attends with SDPA).
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_KIND_NAMES = {0: "f32", 1: "bf16"}
_SEQ_FIELDS = 7  # a sequence's row of the table: base, kv, head and position strides, start, first, seen
# Below this many multiply-adds (sum of seen x H x D) one thread does the work: a parallel
# region costs a few microseconds, more than a very short context's whole attention. Measured
# in the engine on a 2-core AMD EPYC (SmolLM2, 24-token prompts, 96 tokens, alternating in
# one process, medians of 4): 1 << 18 -> 1 << 13 took four streams 451 -> 476 tok/s (their
# ~60-120 keys had run on one thread), one stream 197 -> 200.
_PARALLEL_WORK = 1 << 13

_DECLARE = """
declare float @llvm.sqrt.f32(float)
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare <8 x float> @llvm.rint.v8f32(<8 x float>)
declare <8 x float> @llvm.maxnum.v8f32(<8 x float>, <8 x float>)
declare float @llvm.maxnum.f32(float, float)
declare float @llvm.fma.f32(float, float, float)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
"""


def _load(kind: int, ptr: str, index: str, out: str) -> list[str]:
    """IR: <8 x float> `out` = 8 values of the KV copy's dtype at element `index` of `ptr`."""
    t = out.lstrip("%")
    if kind == 0:
        return [f"  %{t}_p = getelementptr float, ptr {ptr}, i64 {index}",
                f"  {out} = load <8 x float>, ptr %{t}_p, align 4"]
    return [f"  %{t}_p = getelementptr i16, ptr {ptr}, i64 {index}",
            f"  %{t}_h = load <8 x i16>, ptr %{t}_p, align 2",
            f"  %{t}_w = zext <8 x i16> %{t}_h to <8 x i32>",
            f"  %{t}_s = shl <8 x i32> %{t}_w, splat (i32 16)",
            f"  {out} = bitcast <8 x i32> %{t}_s to <8 x float>"]


def _prefetch(kind: int, ptr: str, index: str, tag: str) -> list[str]:
    """IR: ask for the cache line holding element `index` of the KV copy at `ptr`."""
    ty = "float" if kind == 0 else "i16"
    return [f"  %{tag}_p = getelementptr {ty}, ptr {ptr}, i64 {index}",
            f"  call void @llvm.prefetch.p0(ptr %{tag}_p, i32 0, i32 3, i32 1)"]


def _store(kind: int, ptr: str, index: str, value: str, tag: str) -> list[str]:
    """IR: store <8 x float> `value` into 8 values of the copy's dtype (bfloat16 rounded to
    nearest even, NaN as 0x7FC0, as torch converts)."""
    if kind == 0:
        return [f"  %{tag}_p = getelementptr float, ptr {ptr}, i64 {index}",
                f"  store <8 x float> {value}, ptr %{tag}_p, align 4"]
    return [f"  %{tag}_b = bitcast <8 x float> {value} to <8 x i32>",
            f"  %{tag}_l = lshr <8 x i32> %{tag}_b, splat (i32 16)",
            f"  %{tag}_o = and <8 x i32> %{tag}_l, splat (i32 1)",
            f"  %{tag}_r0 = add <8 x i32> %{tag}_b, splat (i32 32767)",
            f"  %{tag}_r1 = add <8 x i32> %{tag}_r0, %{tag}_o",
            f"  %{tag}_hi = lshr <8 x i32> %{tag}_r1, splat (i32 16)",
            f"  %{tag}_nan = fcmp uno <8 x float> {value}, {value}",
            f"  %{tag}_sel = select <8 x i1> %{tag}_nan, <8 x i32> splat (i32 32704), <8 x i32> %{tag}_hi",
            f"  %{tag}_t = trunc <8 x i32> %{tag}_sel to <8 x i16>",
            f"  %{tag}_p = getelementptr i16, ptr {ptr}, i64 {index}",
            f"  store <8 x i16> %{tag}_t, ptr %{tag}_p, align 2"]


def _f(value: float) -> str:
    """An LLVM float constant: `value` rounded to float32, written as LLVM writes it."""
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", struct.unpack("<f", struct.pack("<f", value))[0]))[0]


def _splat(value: float) -> str:
    return f"splat (float {_f(value)})"


# exp(x) for x <= 0 (a score minus the maximum): 2^n * e^r with n = rint(x / ln 2), r the
# rest, e^r by Cephes' expf polynomial; below -87 it is clamped (e^-87 ~ 1.6e-38, nothing
# next to the maximum's 1).
_EXP = f"""
define internal <8 x float> @attn_exp8(<8 x float> %x0) alwaysinline {{
entry:
  %x = call <8 x float> @llvm.maxnum.v8f32(<8 x float> %x0, <8 x float> {_splat(-87.0)})
  %t = fmul <8 x float> %x, {_splat(1.44269504088896341)}
  %n = call <8 x float> @llvm.rint.v8f32(<8 x float> %t)
  %r0 = call <8 x float> @llvm.fma.v8f32(<8 x float> %n, <8 x float> {_splat(-0.693359375)}, <8 x float> %x)
  %r = call <8 x float> @llvm.fma.v8f32(<8 x float> %n, <8 x float> {_splat(2.12194440e-4)}, <8 x float> %r0)
  %p0 = call <8 x float> @llvm.fma.v8f32(<8 x float> {_splat(1.9875691500e-4)}, <8 x float> %r, <8 x float> {_splat(1.3981999507e-3)})
  %p1 = call <8 x float> @llvm.fma.v8f32(<8 x float> %p0, <8 x float> %r, <8 x float> {_splat(8.3334519073e-3)})
  %p2 = call <8 x float> @llvm.fma.v8f32(<8 x float> %p1, <8 x float> %r, <8 x float> {_splat(4.1665795894e-2)})
  %p3 = call <8 x float> @llvm.fma.v8f32(<8 x float> %p2, <8 x float> %r, <8 x float> {_splat(1.6666665459e-1)})
  %p4 = call <8 x float> @llvm.fma.v8f32(<8 x float> %p3, <8 x float> %r, <8 x float> {_splat(5.0000001201e-1)})
  %r2 = fmul <8 x float> %r, %r
  %p5 = call <8 x float> @llvm.fma.v8f32(<8 x float> %p4, <8 x float> %r2, <8 x float> %r)
  %e = fadd <8 x float> %p5, {_splat(1.0)}
  %ni = fptosi <8 x float> %n to <8 x i32>
  %nb = add <8 x i32> %ni, splat (i32 127)
  %sh = shl <8 x i32> %nb, splat (i32 23)
  %pw = bitcast <8 x i32> %sh to <8 x float>
  %y = fmul <8 x float> %e, %pw
  ret <8 x float> %y
}}
"""


def _prep_ir(kind: int) -> str:
    """attn_prep_<kind>(qkv, cos, sin, qkn, has_qkn, eps, seqs, N, H, Hkv, D, half, scale, qbuf, tmp):
    per sequence, its query heads normed (optionally), rotated and scaled into qbuf [N, H, D]
    float32, its key head(s) normed, rotated and written, its value head(s) written."""
    k = _KIND_NAMES[kind]
    L = [f"define internal void @attn_prep_{k}(ptr %qkv, ptr %cos, ptr %sin, ptr %qkn, i64 %has_qkn, "
         "float %eps, ptr %seqs, i64 %N, i64 %H, i64 %Hkv, i64 %D, i64 %half, float %scale, ptr %qbuf, "
         "ptr %tmp) {",
         "entry:",
         "  %nc = lshr i64 %D, 3",
         "  %hD = lshr i64 %D, 1",
         "  %Hq = add i64 %H, %Hkv",
         "  %Hall = add i64 %Hq, %Hkv",
         "  %rowlen = mul i64 %Hall, %D",
         "  %Df = uitofp i64 %D to float",
         "  %normed = icmp ne i64 %has_qkn, 0",
         "  %halfstyle = icmp ne i64 %half, 0",
         "  %scv0 = insertelement <8 x float> poison, float %scale, i32 0",
         "  %scv = shufflevector <8 x float> %scv0, <8 x float> poison, <8 x i32> zeroinitializer",
         "  br label %seq",
         # ---- per sequence
         "seq:",
         "  %i = phi i64 [0, %entry], [%in, %seq_end]",
         f"  %tb = mul i64 %i, {_SEQ_FIELDS}",
         "  %t0p = getelementptr i64, ptr %seqs, i64 %tb",
         "  %base_i = load i64, ptr %t0p",
         "  %base = inttoptr i64 %base_i to ptr",
         "  %t1p = getelementptr i64, ptr %t0p, i64 1",
         "  %kvs = load i64, ptr %t1p",
         "  %t2p = getelementptr i64, ptr %t0p, i64 2",
         "  %hs = load i64, ptr %t2p",
         "  %t3p = getelementptr i64, ptr %t0p, i64 3",
         "  %ps = load i64, ptr %t3p",
         "  %t4p = getelementptr i64, ptr %t0p, i64 4",
         "  %start = load i64, ptr %t4p",
         "  %slot = mul i64 %start, %ps",
         "  %rowo = mul i64 %i, %rowlen",
         "  %row = getelementptr float, ptr %qkv, i64 %rowo",
         "  %tro = mul i64 %i, %D",
         "  %cosr = getelementptr float, ptr %cos, i64 %tro",
         "  %sinr = getelementptr float, ptr %sin, i64 %tro",
         "  br label %head",
         # ---- per head of the row
         "head:",
         "  %h = phi i64 [0, %seq], [%hn, %head_end]",
         "  %ho = mul i64 %h, %D",
         "  %src = getelementptr float, ptr %row, i64 %ho",
         "  %isv = icmp uge i64 %h, %Hq",
         "  br i1 %isv, label %val, label %qk",
         # a value head: straight into the copy
         "val:",
         "  %vh = sub i64 %h, %Hq",
         "  %vho = mul i64 %vh, %hs",
         "  %vo0 = add i64 %kvs, %vho",
         "  %vo = add i64 %vo0, %slot",
         "  br label %vc",
         "vc:",
         "  %c_v = phi i64 [0, %val], [%cn_v, %vc]",
         "  %e_v = shl i64 %c_v, 3",
         "  %sp_v = getelementptr float, ptr %src, i64 %e_v",
         "  %x_v = load <8 x float>, ptr %sp_v, align 4",
         "  %di_v = add i64 %vo, %e_v",
         *_store(kind, "%base", "%di_v", "%x_v", "sv"),
         "  %cn_v = add i64 %c_v, 1",
         "  %more_v = icmp ult i64 %cn_v, %nc",
         "  br i1 %more_v, label %vc, label %head_end",
         # a query or key head: the norm's factor first
         "qk:",
         "  br i1 %normed, label %ss, label %copy_pre",
         "ss:",
         "  %c_s = phi i64 [0, %qk], [%cn_s, %ss]",
         "  %a_s = phi <8 x float> [zeroinitializer, %qk], [%an_s, %ss]",
         "  %e_s = shl i64 %c_s, 3",
         "  %sp_s = getelementptr float, ptr %src, i64 %e_s",
         "  %x_s = load <8 x float>, ptr %sp_s, align 4",
         "  %an_s = call <8 x float> @llvm.fma.v8f32(<8 x float> %x_s, <8 x float> %x_s, <8 x float> %a_s)",
         "  %cn_s = add i64 %c_s, 1",
         "  %more_s = icmp ult i64 %cn_s, %nc",
         "  br i1 %more_s, label %ss, label %ss_done",
         "ss_done:",
         *int8_products.sum8_ir("%an_s", "%sumsq", "hq"),
         "  %mean = fdiv float %sumsq, %Df",
         "  %me = fadd float %mean, %eps",
         "  %rt = call float @llvm.sqrt.f32(float %me)",
         "  %rinv = fdiv float 1.0, %rt",
         "  br label %copy_pre",
         "copy_pre:",
         "  %f = phi float [1.0, %qk], [%rinv, %ss_done]",
         "  %fv0 = insertelement <8 x float> poison, float %f, i32 0",
         "  %fv = shufflevector <8 x float> %fv0, <8 x float> poison, <8 x i32> zeroinitializer",
         "  %wo = mul i64 %h, %D",
         "  br label %cp",
         "cp:",
         "  %c_c = phi i64 [0, %copy_pre], [%cn_c, %cp_next]",
         "  %e_c = shl i64 %c_c, 3",
         "  %sp_c = getelementptr float, ptr %src, i64 %e_c",
         "  %x_c = load <8 x float>, ptr %sp_c, align 4",
         "  %y_c = fmul <8 x float> %x_c, %fv",
         "  br i1 %normed, label %cpw, label %cp_next",
         "cpw:",
         "  %wi_c = add i64 %wo, %e_c",
         "  %wp_c = getelementptr float, ptr %qkn, i64 %wi_c",
         "  %w_c = load <8 x float>, ptr %wp_c, align 4",
         "  %yw_c = fmul <8 x float> %y_c, %w_c",
         "  br label %cp_next",
         "cp_next:",
         "  %z_c = phi <8 x float> [%y_c, %cp], [%yw_c, %cpw]",
         "  %tp_c = getelementptr float, ptr %tmp, i64 %e_c",
         "  store <8 x float> %z_c, ptr %tp_c, align 4",
         "  %cn_c = add i64 %c_c, 1",
         "  %more_c = icmp ult i64 %cn_c, %nc",
         "  br i1 %more_c, label %cp, label %rope_pre",
         # RoPE from tmp: a query head into qbuf (scaled), a key head into the copy
         "rope_pre:",
         "  %isq = icmp ult i64 %h, %H",
         "  %kh = sub i64 %h, %H",
         "  %kho = mul i64 %kh, %hs",
         "  %ko = add i64 %kho, %slot",
         "  %qi0 = mul i64 %i, %H",
         "  %qi1 = add i64 %qi0, %h",
         "  %qo = mul i64 %qi1, %D",
         "  br label %rp",
         "rp:",
         "  %c_r = phi i64 [0, %rope_pre], [%cn_r, %rp_next]",
         "  %e_r = shl i64 %c_r, 3",
         "  %tp_r = getelementptr float, ptr %tmp, i64 %e_r",
         "  %x_r = load <8 x float>, ptr %tp_r, align 4",
         "  %pe0 = add i64 %e_r, %hD",
         "  %pwrap = icmp uge i64 %pe0, %D",
         "  %pe1 = sub i64 %pe0, %D",
         "  %pe = select i1 %pwrap, i64 %pe1, i64 %pe0",
         "  %pp_r = getelementptr float, ptr %tmp, i64 %pe",
         "  %xh_r = load <8 x float>, ptr %pp_r, align 4",
         "  %xi_r = shufflevector <8 x float> %x_r, <8 x float> poison, <8 x i32> <i32 1, i32 0, i32 3, i32 2, i32 5, i32 4, i32 7, i32 6>",
         "  %xp_r = select i1 %halfstyle, <8 x float> %xh_r, <8 x float> %xi_r",
         "  %cs_p = getelementptr float, ptr %cosr, i64 %e_r",
         "  %cs = load <8 x float>, ptr %cs_p, align 4",
         "  %sn_p = getelementptr float, ptr %sinr, i64 %e_r",
         "  %sn = load <8 x float>, ptr %sn_p, align 4",
         "  %xc = fmul <8 x float> %x_r, %cs",
         "  %ro = call <8 x float> @llvm.fma.v8f32(<8 x float> %xp_r, <8 x float> %sn, <8 x float> %xc)",
         "  br i1 %isq, label %rq, label %rk",
         "rq:",
         "  %rs = fmul <8 x float> %ro, %scv",
         "  %qd0 = add i64 %qo, %e_r",
         "  %qd = getelementptr float, ptr %qbuf, i64 %qd0",
         "  store <8 x float> %rs, ptr %qd, align 4",
         "  br label %rp_next",
         "rk:",
         "  %kd = add i64 %ko, %e_r",
         *_store(kind, "%base", "%kd", "%ro", "sk"),
         "  br label %rp_next",
         "rp_next:",
         "  %cn_r = add i64 %c_r, 1",
         "  %more_r = icmp ult i64 %cn_r, %nc",
         "  br i1 %more_r, label %rp, label %head_end",
         "head_end:",
         "  %hn = add i64 %h, 1",
         "  %hmore = icmp ult i64 %hn, %Hall",
         "  br i1 %hmore, label %head, label %seq_end",
         "seq_end:",
         "  %in = add i64 %i, 1",
         "  %imore = icmp ult i64 %in, %N",
         "  br i1 %imore, label %seq, label %done",
         "done:",
         "  ret void",
         "}"]
    return "\n".join(L)


# Keys a part of the attention takes: a sequence's keys are split into parts of this many,
# each (sequence, KV head, part) a work item, merged after (`_merge_ir`). Fixed, so a
# sequence's result depends on its own length only, never on the batch or the threads.
PART_KEYS = 512
# Keys ahead whose rows (and values) a part asks for while it multiplies the current ones.
PREFETCH_KEYS = 16
# Query heads sharing a KV head that one item takes together (each key loaded once for all).
MAX_GROUP = 8


def _part_ir(kind: int, G: int) -> str:
    """attn_part_<kind>_<G>(q, base, koff, voff, ps, n, D, sbuf, ob, mb, lb): G query heads
    (q [G, D] float32, scaled) over n <= PART_KEYS keys of their KV head (keys at
    base[koff + t * ps], values at base[voff + t * ps]): per head its scores' maximum m
    (mb[g]), the sum l of exp(s - m) (lb[g]) and sum_t exp(s_t - m) v_t (ob [G, D]); sbuf
    [G, PART_KEYS] holds the scores. Keys two at a time: 2G independent chains of
    multiply-adds."""
    k = _KIND_NAMES[kind]
    gs = range(G)
    L = [f"define internal void @attn_part_{k}_{G}(ptr %q, ptr %base, i64 %koff, i64 %voff, i64 %ps, "
         "i64 %n, i64 %D, ptr %sbuf, ptr %ob, ptr %mb, ptr %lb) {",
         "entry:",
         "  %nc = lshr i64 %D, 3",
         "  %n2 = and i64 %n, -2",
         "  %any2 = icmp ugt i64 %n2, 0",
         f"  %pfd = mul i64 %ps, {PREFETCH_KEYS}",
         "  %vgap = sub i64 %voff, %koff"]
    L += [f"  %qg{g} = getelementptr float, ptr %q, i64 {0}" if g == 0 else
          f"  %qg{g} = getelementptr float, ptr %qg{g - 1}, i64 %D" for g in gs]
    L += [f"  %sg{g} = getelementptr float, ptr %sbuf, i64 {g * PART_KEYS}" for g in gs]
    # the first PREFETCH_KEYS keys' and values' lines asked for at once (the passes below ask
    # PREFETCH_KEYS ahead, so a part's first keys, and its values' first, had come a line at
    # a time: a short sequence's part is mostly those). With the values' W below, timed per
    # thread in the engine (SmolLM2, 2-core AMD EPYC): four streams of 24-token prompts, the
    # attention's share of a step 514-579 -> 435-526 us a thread; one stream after 1,000
    # tokens 1,388-1,421 -> 1,241-1,301 us.
    line = 64 // (4 if kind == 0 else 2)
    L += ["  %pf0big = icmp ugt i64 %n, " + str(PREFETCH_KEYS),
          f"  %pf0n = select i1 %pf0big, i64 {PREFETCH_KEYS}, i64 %n",
          "  %pf0any = icmp ugt i64 %pf0n, 0",
          "  br i1 %pf0any, label %pf0, label %pf0_done",
          "pf0:", "  %pf0t = phi i64 [0, %entry], [%pf0tn, %pf0_row]",
          "  %pf0r0 = mul i64 %pf0t, %ps", "  %pf0r = add i64 %pf0r0, %koff", "  br label %pf0_line",
          "pf0_line:", "  %pf0e = phi i64 [0, %pf0], [%pf0en, %pf0_line]",
          "  %pf0k = add i64 %pf0r, %pf0e"]
    L += _prefetch(kind, "%base", "%pf0k", "pf0kk")
    L += ["  %pf0v = add i64 %pf0k, %vgap"] + _prefetch(kind, "%base", "%pf0v", "pf0vv")
    L += [f"  %pf0en = add i64 %pf0e, {line}", "  %pf0em = icmp ult i64 %pf0en, %D",
          "  br i1 %pf0em, label %pf0_line, label %pf0_row",
          "pf0_row:", "  %pf0tn = add i64 %pf0t, 1", "  %pf0tm = icmp ult i64 %pf0tn, %pf0n",
          "  br i1 %pf0tm, label %pf0, label %pf0_done",
          "pf0_done:"]
    L += ["  br i1 %any2, label %s2, label %s1_pre",
          "s2:",
          "  %j = phi i64 [0, %pf0_done], [%jn, %s2_end]"]
    L += [f"  %m_{g} = phi float [0xFFF0000000000000, %pf0_done], [%m2n_{g}, %s2_end]" for g in gs]
    for u in range(2):
        L += [f"  %ja{u} = add i64 %j, {u}", f"  %jb{u} = mul i64 %ja{u}, %ps", f"  %kr{u} = add i64 %jb{u}, %koff"]
    # the keys PREFETCH_KEYS ahead, and their values for the pass after, a cache line at a
    # time (the module docstring: the rows come from memory)
    L += [f"  %pfa = add i64 %kr0, %pfd", f"  %pfz = add i64 %kr1, %pfd", "  %pfe = add i64 %pfz, %D",
          "  br label %pf2", "pf2:", "  %pfi = phi i64 [%pfa, %s2], [%pfn, %pf2]"]
    L += _prefetch(kind, "%base", "%pfi", "pfk")
    L += ["  %pfv = add i64 %pfi, %vgap"] + _prefetch(kind, "%base", "%pfv", "pfvv")
    L += [f"  %pfn = add i64 %pfi, {line}", "  %pfm = icmp ult i64 %pfn, %pfe",
          "  br i1 %pfm, label %pf2, label %c2_pre", "c2_pre:"]
    L += ["  br label %c2", "c2:", "  %c = phi i64 [0, %c2_pre], [%cn, %c2]"]
    L += [f"  %a_{g}_{u} = phi <8 x float> [zeroinitializer, %c2_pre], [%an_{g}_{u}, %c2]" for g in gs for u in range(2)]
    L += ["  %e = shl i64 %c, 3"]
    for u in range(2):
        L += [f"  %ke{u} = add i64 %kr{u}, %e"] + _load(kind, "%base", f"%ke{u}", f"%kv{u}")
    for g in gs:
        L += [f"  %qp{g} = getelementptr float, ptr %qg{g}, i64 %e",
              f"  %qv{g} = load <8 x float>, ptr %qp{g}, align 4"]
        for u in range(2):
            L += [f"  %an_{g}_{u} = call <8 x float> @llvm.fma.v8f32(<8 x float> %qv{g}, <8 x float> %kv{u}, <8 x float> %a_{g}_{u})"]
    L += ["  %cn = add i64 %c, 1", "  %cmore = icmp ult i64 %cn, %nc",
          "  br i1 %cmore, label %c2, label %s2_end", "s2_end:"]
    for g in gs:
        for u in range(2):
            L += int8_products.sum8_ir(f"%an_{g}_{u}", f"%s_{g}_{u}", f"h{g}x{u}")
            L += [f"  %sp_{g}_{u} = getelementptr float, ptr %sg{g}, i64 %ja{u}",
                  f"  store float %s_{g}_{u}, ptr %sp_{g}_{u}, align 4"]
        L += [f"  %mm_{g} = call float @llvm.maxnum.f32(float %s_{g}_0, float %s_{g}_1)",
              f"  %m2n_{g} = call float @llvm.maxnum.f32(float %m_{g}, float %mm_{g})"]
    L += ["  %jn = add i64 %j, 2", "  %jmore = icmp ult i64 %jn, %n2",
          "  br i1 %jmore, label %s2, label %s1_pre",
          "s1_pre:"]
    L += [f"  %m1_{g} = phi float [0xFFF0000000000000, %pf0_done], [%m2n_{g}, %s2_end]" for g in gs]
    L += ["  %rest = icmp ult i64 %n2, %n", "  br i1 %rest, label %s1, label %soft_pre",
          "s1:", "  %k1a = mul i64 %n2, %ps", "  %k1 = add i64 %k1a, %koff", "  br label %c1",
          "c1:", "  %d = phi i64 [0, %s1], [%dn, %c1]"]
    L += [f"  %b_{g} = phi <8 x float> [zeroinitializer, %s1], [%bn_{g}, %c1]" for g in gs]
    L += ["  %f = shl i64 %d, 3", "  %kf = add i64 %k1, %f"] + _load(kind, "%base", "%kf", "%kw")
    for g in gs:
        L += [f"  %rp{g} = getelementptr float, ptr %qg{g}, i64 %f",
              f"  %rv{g} = load <8 x float>, ptr %rp{g}, align 4",
              f"  %bn_{g} = call <8 x float> @llvm.fma.v8f32(<8 x float> %rv{g}, <8 x float> %kw, <8 x float> %b_{g})"]
    L += ["  %dn = add i64 %d, 1", "  %dmore = icmp ult i64 %dn, %nc",
          "  br i1 %dmore, label %c1, label %s1_end", "s1_end:"]
    for g in gs:
        L += int8_products.sum8_ir(f"%bn_{g}", f"%t_{g}", f"h1{g}")
        L += [f"  %tp_{g} = getelementptr float, ptr %sg{g}, i64 %n2",
              f"  store float %t_{g}, ptr %tp_{g}, align 4",
              f"  %mf_{g} = call float @llvm.maxnum.f32(float %m1_{g}, float %t_{g})"]
    L += ["  br label %soft_pre", "soft_pre:"]
    L += [f"  %mx_{g} = phi float [%m1_{g}, %s1_pre], [%mf_{g}, %s1_end]" for g in gs]
    lanes = ", ".join(f"i64 {j}" for j in range(8))
    L += ["  %nv0 = insertelement <8 x i64> poison, i64 %n, i32 0",
          "  %nv = shufflevector <8 x i64> %nv0, <8 x i64> poison, <8 x i32> zeroinitializer"]
    prev = "soft_pre"
    for g in gs:  # exp(s - max), zero past n, and their sum, head by head
        L += [f"  %mv0_{g} = insertelement <8 x float> poison, float %mx_{g}, i32 0",
              f"  %mv_{g} = shufflevector <8 x float> %mv0_{g}, <8 x float> poison, <8 x i32> zeroinitializer",
              f"  br label %soft{g}", f"soft{g}:",
              f"  %o_{g} = phi i64 [0, %{prev}], [%on_{g}, %soft{g}]",
              f"  %l_{g} = phi <8 x float> [zeroinitializer, %{prev}], [%ln_{g}, %soft{g}]",
              f"  %op_{g} = getelementptr float, ptr %sg{g}, i64 %o_{g}",
              f"  %ov_{g} = load <8 x float>, ptr %op_{g}, align 4",
              f"  %od_{g} = fsub <8 x float> %ov_{g}, %mv_{g}",
              f"  %oe_{g} = call <8 x float> @attn_exp8(<8 x float> %od_{g})",
              f"  %oi0_{g} = insertelement <8 x i64> poison, i64 %o_{g}, i32 0",
              f"  %oi1_{g} = shufflevector <8 x i64> %oi0_{g}, <8 x i64> poison, <8 x i32> zeroinitializer",
              f"  %oi_{g} = add <8 x i64> %oi1_{g}, <{lanes}>",
              f"  %ok_{g} = icmp ult <8 x i64> %oi_{g}, %nv",
              f"  %oz_{g} = select <8 x i1> %ok_{g}, <8 x float> %oe_{g}, <8 x float> zeroinitializer",
              f"  store <8 x float> %oz_{g}, ptr %op_{g}, align 4",
              f"  %ln_{g} = fadd <8 x float> %l_{g}, %oz_{g}",
              f"  %on_{g} = add i64 %o_{g}, 8",
              f"  %omore_{g} = icmp ult i64 %on_{g}, %n",
              f"  br i1 %omore_{g}, label %soft{g}, label %soft{g}_done",
              f"soft{g}_done:"]
        L += int8_products.sum8_ir(f"%ln_{g}", f"%lsum_{g}", f"hl{g}")
        L += [f"  %mbp_{g} = getelementptr float, ptr %mb, i64 {g}",
              f"  store float %mx_{g}, ptr %mbp_{g}, align 4",
              f"  %lbp_{g} = getelementptr float, ptr %lb, i64 {g}",
              f"  store float %lsum_{g}, ptr %lbp_{g}, align 4"]
        prev = f"soft{g}_done"
    # the values' weighted sums: W vectors of each head a pass over the keys, W by D
    L += ["  %nvec = lshr i64 %D, 3"]
    # (the G * W accumulators, the W value vectors and a weight's broadcast within AVX2's 16
    # registers: SmolLM2's G 3 at W 4 had spilled an accumulator, and LLVM then rotated the
    # other eleven through registers at every key, ~40% of the attention's samples)
    choices = sorted({w for w in (4, 2, 1) if G * w + w + 1 <= 16} or {1}, reverse=True)
    # pick at run time the widest W that divides D / 8
    conds = []
    for w in choices:
        conds.append(w)
    L += [f"  br label %vsel"]
    L += ["vsel:"]
    for idx, w in enumerate(conds):
        nxt = f"vsel{idx + 1}" if idx + 1 < len(conds) else f"vw{conds[-1]}"
        if idx + 1 < len(conds):
            L += [f"  %vr{w} = urem i64 %nvec, {w}", f"  %vz{w} = icmp eq i64 %vr{w}, 0",
                  f"  br i1 %vz{w}, label %vw{w}, label %{nxt}", f"{nxt}:"]
        else:
            L += [f"  br label %vw{w}"]
    for w in conds:
        L += [f"vw{w}:", f"  br label %vb{w}", f"vb{w}:",
              f"  %vk{w} = phi i64 [0, %vw{w}], [%vkn{w}, %vb{w}_end]",
              f"  %vko{w} = mul i64 %vk{w}, {8 * w}",
              f"  br label %vt{w}", f"vt{w}:",
              f"  %vt_{w} = phi i64 [0, %vb{w}], [%vtn_{w}, %vt{w}]"]
        L += [f"  %acc{w}_{g}_{x} = phi <8 x float> [zeroinitializer, %vb{w}], [%accn{w}_{g}_{x}, %vt{w}]"
              for g in gs for x in range(w)]
        L += [f"  %vr0_{w} = mul i64 %vt_{w}, %ps", f"  %vr1_{w} = add i64 %vr0_{w}, %voff",
              f"  %vr2_{w} = add i64 %vr1_{w}, %vko{w}"]
        # the value PREFETCH_KEYS ahead: its first and last of these 8 w elements' lines
        L += [f"  %vpf{w} = add i64 %vr2_{w}, %pfd", f"  %vpl{w} = add i64 %vpf{w}, {8 * w - 1}"]
        L += _prefetch(kind, "%base", f"%vpf{w}", f"vpa{w}") + _prefetch(kind, "%base", f"%vpl{w}", f"vpb{w}")
        for x in range(w):
            L += [f"  %ve{w}_{x} = add i64 %vr2_{w}, {8 * x}"] + _load(kind, "%base", f"%ve{w}_{x}", f"%vv{w}_{x}")
        for g in gs:
            L += [f"  %pp{w}_{g} = getelementptr float, ptr %sg{g}, i64 %vt_{w}",
                  f"  %p{w}_{g} = load float, ptr %pp{w}_{g}, align 4",
                  f"  %pb0{w}_{g} = insertelement <8 x float> poison, float %p{w}_{g}, i32 0",
                  f"  %pb{w}_{g} = shufflevector <8 x float> %pb0{w}_{g}, <8 x float> poison, <8 x i32> zeroinitializer"]
            for x in range(w):
                L += [f"  %accn{w}_{g}_{x} = call <8 x float> @llvm.fma.v8f32(<8 x float> %pb{w}_{g}, <8 x float> %vv{w}_{x}, <8 x float> %acc{w}_{g}_{x})"]
        L += [f"  %vtn_{w} = add i64 %vt_{w}, 1", f"  %vtm_{w} = icmp ult i64 %vtn_{w}, %n",
              f"  br i1 %vtm_{w}, label %vt{w}, label %vb{w}_end", f"vb{w}_end:"]
        for g in gs:
            for x in range(w):
                L += [f"  %so{w}_{g}_{x}a = mul i64 %D, {g}",
                      f"  %so{w}_{g}_{x}b = add i64 %so{w}_{g}_{x}a, %vko{w}",
                      f"  %so{w}_{g}_{x} = add i64 %so{w}_{g}_{x}b, {8 * x}",
                      f"  %sop{w}_{g}_{x} = getelementptr float, ptr %ob, i64 %so{w}_{g}_{x}",
                      f"  store <8 x float> %accn{w}_{g}_{x}, ptr %sop{w}_{g}_{x}, align 4"]
        L += [f"  %vkn{w} = add i64 %vk{w}, 1", f"  %vkm{w} = mul i64 %vkn{w}, {w}",
              f"  %vkmore{w} = icmp ult i64 %vkm{w}, %nvec",
              f"  br i1 %vkmore{w}, label %vb{w}, label %fin"]
    L += ["fin:", "  ret void", "}"]
    return "\n".join(L)


# The parallel part's arguments.
_ARGS = "%attn_args = type { ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr }"
_ARG_TYPES = ("ptr", "i64", "i64", "i64", "i64", "i64", "ptr", "ptr", "i64", "ptr", "ptr", "ptr")
_ARG_NAMES = ("seqs", "N", "H", "Hkv", "D", "kind", "qbuf", "sbufs", "cmax", "obufs", "mbufs", "lbufs")


def _seq_fields(L: list, row: str) -> None:
    """IR loading a sequence's table row `row` (an i64 index) into %base, %kvs, %hs, %ps,
    %start, %first and %seen_t."""
    L += [f"  %tb = mul i64 {row}, {_SEQ_FIELDS}", "  %t0p = getelementptr i64, ptr %seqs, i64 %tb"]
    for f, name in enumerate(("base_i", "kvs", "hs", "ps", "start", "first", "seen_t")):
        L += [f"  %f{f}p = getelementptr i64, ptr %t0p, i64 {f}", f"  %{name} = load i64, ptr %f{f}p"]
    L += ["  %base = inttoptr i64 %base_i to ptr"]


def _work_ir() -> str:
    """attn_work(args, tid, nth): items tid, tid + nth, ... of the N * Hkv * cmax (sequence,
    KV head, part of PART_KEYS keys); parts past a sequence's keys are skipped."""
    L = ["define internal void @attn_work(ptr %argp, i64 %tid, i64 %nth) {", "entry:"]
    for i, (ty, name) in enumerate(zip(_ARG_TYPES, _ARG_NAMES)):
        L += [f"  %{name}_p = getelementptr %attn_args, ptr %argp, i32 0, i32 {i}",
              f"  %{name} = load {ty}, ptr %{name}_p"]
    L += ["  %G = udiv i64 %H, %Hkv",
          "  %per = mul i64 %Hkv, %cmax",
          "  %items = mul i64 %N, %per",
          "  %limit = mul i64 %cmax, " + str(PART_KEYS),
          f"  %sbo0 = mul i64 %tid, %G",
          f"  %sbo = mul i64 %sbo0, {PART_KEYS}",
          "  %sbuf = getelementptr float, ptr %sbufs, i64 %sbo",
          "  %sel0 = mul i64 %kind, 16",
          "  %sel = add i64 %sel0, %G",
          "  %any = icmp ult i64 %tid, %items",
          "  br i1 %any, label %item, label %fin",
          "item:",
          "  %it = phi i64 [%tid, %entry], [%itn, %item_end]",
          "  %i = udiv i64 %it, %per",
          "  %rem = urem i64 %it, %per",
          "  %kvh = udiv i64 %rem, %cmax",
          "  %c = urem i64 %rem, %cmax"]
    _seq_fields(L, "%i")
    L += ["  %over = icmp ugt i64 %seen_t, %limit",  # (never, from `plan`: the buffers bound it)
          "  %seen = select i1 %over, i64 %limit, i64 %seen_t",
          f"  %k0 = mul i64 %c, {PART_KEYS}",
          "  %inside = icmp ult i64 %k0, %seen",
          "  br i1 %inside, label %go, label %item_end",
          "go:",
          "  %left = sub i64 %seen, %k0",
          f"  %big = icmp ugt i64 %left, {PART_KEYS}",
          f"  %n = select i1 %big, i64 {PART_KEYS}, i64 %left",
          "  %kh = mul i64 %kvh, %hs",
          "  %fk = add i64 %first, %k0",
          "  %fo = mul i64 %fk, %ps",
          "  %koff = add i64 %kh, %fo",
          "  %voff = add i64 %koff, %kvs",
          "  %qh0 = mul i64 %i, %H",
          "  %qh1 = mul i64 %kvh, %G",
          "  %qh = add i64 %qh0, %qh1",
          "  %qo = mul i64 %qh, %D",
          "  %qp = getelementptr float, ptr %qbuf, i64 %qo",
          "  %pi0 = mul i64 %i, %Hkv",
          "  %pi1 = add i64 %pi0, %kvh",
          "  %pi2 = mul i64 %pi1, %cmax",
          "  %pi = add i64 %pi2, %c",
          "  %pg = mul i64 %pi, %G",
          "  %pgd = mul i64 %pg, %D",
          "  %obp = getelementptr float, ptr %obufs, i64 %pgd",
          "  %mbp = getelementptr float, ptr %mbufs, i64 %pg",
          "  %lbp = getelementptr float, ptr %lbufs, i64 %pg"]
    cases = " ".join(f"i64 {kind * 16 + G}, label %k{kind}_{G}" for kind in _KIND_NAMES
                     for G in range(1, MAX_GROUP + 1))
    L += [f"  switch i64 %sel, label %item_end [ {cases} ]"]
    for kind, name in _KIND_NAMES.items():
        for G in range(1, MAX_GROUP + 1):
            L += [f"k{kind}_{G}:",
                  f"  call void @attn_part_{name}_{G}(ptr %qp, ptr %base, i64 %koff, i64 %voff, i64 %ps, "
                  "i64 %n, i64 %D, ptr %sbuf, ptr %obp, ptr %mbp, ptr %lbp)",
                  "  br label %item_end"]
    L += ["item_end:",
          "  %itn = add i64 %it, %nth",
          "  %more = icmp ult i64 %itn, %items",
          "  br i1 %more, label %item, label %fin",
          "fin:", "  ret void", "}"]
    return "\n".join(L)


def _merge_ir() -> str:
    """attn_merge(seqs, N, H, Hkv, D, cmax, obufs, mbufs, lbufs, out): each query head's
    parts joined in order: with M the parts' largest maximum and w_c = exp(m_c - M),
    out = sum_c w_c o_c / sum_c w_c l_c (one part: o / l)."""
    L = ["define internal void @attn_merge(ptr %seqs, i64 %N, i64 %H, i64 %Hkv, i64 %D, i64 %cmax, "
         "ptr %obufs, ptr %mbufs, ptr %lbufs, ptr %out) {",
         "entry:",
         "  %G = udiv i64 %H, %Hkv",
         "  %nc = lshr i64 %D, 3",
         f"  %limit = mul i64 %cmax, {PART_KEYS}",
         "  br label %seq",
         "seq:",
         "  %i = phi i64 [0, %entry], [%in, %seq_end]"]
    _seq_fields(L, "%i")
    L += ["  %over = icmp ugt i64 %seen_t, %limit",
          "  %seen = select i1 %over, i64 %limit, i64 %seen_t",
          f"  %cs0 = add i64 %seen, {PART_KEYS - 1}",
          f"  %C = udiv i64 %cs0, {PART_KEYS}",
          "  br label %head",
          "head:",
          "  %h = phi i64 [0, %seq], [%hn, %head_end]",
          "  %kvh = udiv i64 %h, %G",
          "  %g = urem i64 %h, %G",
          "  %pi0 = mul i64 %i, %Hkv",
          "  %pi1 = add i64 %pi0, %kvh",
          "  %pbase = mul i64 %pi1, %cmax",
          "  %oo0 = mul i64 %i, %H",
          "  %oo1 = add i64 %oo0, %h",
          "  %oo = mul i64 %oo1, %D",
          "  %outp = getelementptr float, ptr %out, i64 %oo",
          "  br label %mx",
          # the largest maximum
          "mx:",
          "  %c = phi i64 [0, %head], [%cn, %mx]",
          "  %M = phi float [0xFFF0000000000000, %head], [%Mn, %mx]",
          "  %mi0 = add i64 %pbase, %c",
          "  %mi1 = mul i64 %mi0, %G",
          "  %mi = add i64 %mi1, %g",
          "  %mp = getelementptr float, ptr %mbufs, i64 %mi",
          "  %m = load float, ptr %mp, align 4",
          "  %Mn = call float @llvm.maxnum.f32(float %M, float %m)",
          "  %cn = add i64 %c, 1",
          "  %cmore = icmp ult i64 %cn, %C",
          "  br i1 %cmore, label %mx, label %zero",
          # out = 0, then each part's weighted sums
          "zero:",
          "  %zd = phi i64 [0, %mx], [%zdn, %zero]",
          "  %ze = shl i64 %zd, 3",
          "  %zp = getelementptr float, ptr %outp, i64 %ze",
          "  store <8 x float> zeroinitializer, ptr %zp, align 4",
          "  %zdn = add i64 %zd, 1",
          "  %zmore = icmp ult i64 %zdn, %nc",
          "  br i1 %zmore, label %zero, label %part",
          "part:",
          "  %pc = phi i64 [0, %zero], [%pcn, %part_end]",
          "  %L = phi float [0.0, %zero], [%Ln, %part_end]",
          "  %qi0 = add i64 %pbase, %pc",
          "  %qi1 = mul i64 %qi0, %G",
          "  %qi = add i64 %qi1, %g",
          "  %qmp = getelementptr float, ptr %mbufs, i64 %qi",
          "  %qm = load float, ptr %qmp, align 4",
          "  %qlp = getelementptr float, ptr %lbufs, i64 %qi",
          "  %ql = load float, ptr %qlp, align 4",
          "  %dm = fsub float %qm, %Mn",
          "  %dv0 = insertelement <8 x float> poison, float %dm, i32 0",
          "  %dv = shufflevector <8 x float> %dv0, <8 x float> poison, <8 x i32> zeroinitializer",
          "  %wv = call <8 x float> @attn_exp8(<8 x float> %dv)",
          "  %w = extractelement <8 x float> %wv, i32 0",
          "  %Ln = call float @llvm.fma.f32(float %w, float %ql, float %L)",
          "  %qo = mul i64 %qi, %D",
          "  %qop = getelementptr float, ptr %obufs, i64 %qo",
          "  br label %acc",
          "acc:",
          "  %ad = phi i64 [0, %part], [%adn, %acc]",
          "  %ae = shl i64 %ad, 3",
          "  %asp = getelementptr float, ptr %qop, i64 %ae",
          "  %as = load <8 x float>, ptr %asp, align 4",
          "  %aop = getelementptr float, ptr %outp, i64 %ae",
          "  %ao = load <8 x float>, ptr %aop, align 4",
          "  %an = call <8 x float> @llvm.fma.v8f32(<8 x float> %wv, <8 x float> %as, <8 x float> %ao)",
          "  store <8 x float> %an, ptr %aop, align 4",
          "  %adn = add i64 %ad, 1",
          "  %amore = icmp ult i64 %adn, %nc",
          "  br i1 %amore, label %acc, label %part_end",
          "part_end:",
          "  %pcn = add i64 %pc, 1",
          "  %pmore = icmp ult i64 %pcn, %C",
          "  br i1 %pmore, label %part, label %scale",
          "scale:",
          "  %inv = fdiv float 1.0, %Ln",
          "  %iv0 = insertelement <8 x float> poison, float %inv, i32 0",
          "  %iv = shufflevector <8 x float> %iv0, <8 x float> poison, <8 x i32> zeroinitializer",
          "  br label %sc",
          "sc:",
          "  %sd = phi i64 [0, %scale], [%sdn, %sc]",
          "  %se = shl i64 %sd, 3",
          "  %sp = getelementptr float, ptr %outp, i64 %se",
          "  %sv = load <8 x float>, ptr %sp, align 4",
          "  %sr = fmul <8 x float> %sv, %iv",
          "  store <8 x float> %sr, ptr %sp, align 4",
          "  %sdn = add i64 %sd, 1",
          "  %smore = icmp ult i64 %sdn, %nc",
          "  br i1 %smore, label %sc, label %head_end",
          "head_end:",
          "  %hn = add i64 %h, 1",
          "  %hmore = icmp ult i64 %hn, %H",
          "  br i1 %hmore, label %head, label %seq_end",
          "seq_end:",
          "  %in = add i64 %i, 1",
          "  %imore = icmp ult i64 %in, %N",
          "  br i1 %imore, label %seq, label %done",
          "done:", "  ret void", "}"]
    return "\n".join(L)


def _driver_ir(threaded: bool) -> str:
    """attend(qkv, cos, sin, qkn, has_qkn, eps, seqs, N, H, Hkv, D, half, kind, scale, qbuf,
    tmp, sbufs, cmax, obufs, mbufs, lbufs, out, threads): the writes and rotations on the
    calling thread, every (sequence, KV head, part) on torch's OpenMP pool when `threaded`,
    then the parts merged on the calling thread."""
    extra, run = int8_products.parallel_ir(threaded, "attn_work", "attn_omp_body")
    prep_args = ("ptr %qkv, ptr %cos, ptr %sin, ptr %qkn, i64 %has_qkn, float %eps, ptr %seqs, "
                 "i64 %N, i64 %H, i64 %Hkv, i64 %D, i64 %half, float %scale, ptr %qbuf, ptr %tmp")
    L = ["define void @attend(ptr %qkv, ptr %cos, ptr %sin, ptr %qkn, i64 %has_qkn, float %eps, "
         "ptr %seqs, i64 %N, i64 %H, i64 %Hkv, i64 %D, i64 %half, i64 %kind, float %scale, "
         "ptr %qbuf, ptr %tmp, ptr %sbufs, i64 %cmax, ptr %obufs, ptr %mbufs, ptr %lbufs, ptr %out, "
         "i32 %threads) {",
         "entry:",
         f"  switch i64 %kind, label %go [ {' '.join(f'i64 {k}, label %p{k}' for k in _KIND_NAMES)} ]"]
    for kind, name in _KIND_NAMES.items():
        L += [f"p{kind}:", f"  call void @attn_prep_{name}({prep_args})", "  br label %go"]
    L += ["go:", "  %a = alloca %attn_args"]
    for i, (ty, name) in enumerate(zip(_ARG_TYPES, _ARG_NAMES)):
        L += [f"  %s{i} = getelementptr %attn_args, ptr %a, i32 0, i32 {i}",
              f"  store {ty} %{name}, ptr %s{i}"]
    L += [*run,
          "  call void @attn_merge(ptr %seqs, i64 %N, i64 %H, i64 %Hkv, i64 %D, i64 %cmax, "
          "ptr %obufs, ptr %mbufs, ptr %lbufs, ptr %out)",
          "  ret void", "}"]
    return extra + "\n".join(L)


def attention_ir(threaded: bool, declared: str) -> str:
    """This kernel's part of the module; `declared` is the rest of it (declarations it
    shares are not repeated)."""
    header = "\n".join(line for line in _DECLARE.strip().splitlines()
                       if line.split("(")[0] + "(" not in declared)
    parts = [header, _ARGS, _EXP]
    parts += [_prep_ir(kind) for kind in _KIND_NAMES]
    parts += [_part_ir(kind, G) for kind in _KIND_NAMES for G in range(1, MAX_GROUP + 1)]
    parts += [_work_ir(), _merge_ir(), _driver_ir(threaded)]
    return "\n".join(parts)


# ---- calling it -------------------------------------------------------------------------------


def fits(head_dim: int) -> bool:
    """Whether heads of `head_dim` can be attended here: whole blocks of 32 lanes."""
    return head_dim > 0 and head_dim % 32 == 0


def serves(layer) -> bool:
    """Whether `layer`'s decode passes attend here (in the scripted step and its Python
    alike): its products multiply 8-bit activations (the format that compiled the kernel),
    its heads fit, RoPE covers them, no soft-capping, and QK-norm (if any) is joined."""
    c = layer.cfg
    joined_norm = layer.q_norm is None and layer.k_norm is None or (
        layer.qk_norm is not None and layer._qk_norm_of
        and layer._qk_norm_of[0] is layer.q_norm and layer._qk_norm_of[1] is layer.k_norm)
    return bool(layer.fmt.int8_acts and fits(c.head_dim) and layer.rope.rotary_dim == c.head_dim
                and c.attn_softcap is None and joined_norm and c.n_heads % c.n_kv_heads == 0
                and c.n_heads // c.n_kv_heads <= MAX_GROUP
                and layer.attn_norm is not None and layer.attn_norm.device.type == "cpu"
                and int8_products.kernel() is not None)


@dataclass(frozen=True)
class Plan:
    """A pass's sequences as the kernel reads them, made once a pass (`plan`): per layer a
    table [N, 7] int64 (a sequence's row: the address of its copy's layer, the strides
    between keys and values, heads and positions, in elements, then the position it writes,
    the first it sees and how many), the copies' dtype (`KV_KINDS`), the most positions any
    sequence sees, and the threads to run on."""

    tables: list
    kind: int
    longest: int
    threads: int


def plan(datas: list[torch.Tensor], starts: list[int], firsts: list[int], seens: list[int],
         layers: list[int], H: int, Hkv: int, D: int) -> Plan:
    """The tables for `layers` (indices into each copy) of sequences whose copies are
    datas[i] [n_layers, 2, Hkv, capacity, D], writing position starts[i] and seeing seens[i]
    positions from firsts[i] (the KV view's `decode_plan`). Every bound the kernel relies on
    is checked here: it trusts the tables it is given."""
    N = len(datas)
    if not N or not (len(starts) == len(firsts) == len(seens) == N):
        raise ValueError("decode_attention: one KV copy, start, first and seen a sequence")
    dtype = datas[0].dtype
    kind = KV_KINDS.get(dtype)
    rows, steps = [], []
    lowest, highest = (min(layers), max(layers)) if layers else (0, -1)
    for data, start, first, seen in zip(datas, starts, firsts, seens):
        if data.dtype != dtype or kind is None or data.dim() != 5 or data.shape[1] != 2 \
                or data.shape[2] != Hkv or data.shape[4] != D or data.stride(4) != 1 \
                or data.device.type != "cpu":
            raise ValueError("decode_attention: a KV copy must be [n_layers, 2, Hkv, capacity, D] "
                             "of float32 or bfloat16 on the CPU, all of one dtype")
        if not (0 <= start < data.shape[3] and seen >= 1 and first >= 0 and first + seen <= data.shape[3]
                and 0 <= lowest and highest < data.shape[0]):
            raise ValueError("decode_attention: positions or layers outside the KV copy")
        rows.append([data.data_ptr(), data.stride(1), data.stride(2), data.stride(3), start, first, seen])
        steps.append(data.stride(0) * data.element_size())
    template = torch.tensor(rows, dtype=torch.int64)
    offsets = torch.tensor(layers, dtype=torch.int64)[:, None] * torch.tensor(steps, dtype=torch.int64)
    tables = template.repeat(len(layers), 1, 1)
    tables[:, :, 0] += offsets
    longest = max(seens)
    k = int8_products.kernel()
    threads = torch.get_num_threads() if k is not None and k.threaded \
        and sum(seens) * H * D >= _PARALLEL_WORK else 1
    return Plan(list(tables.unbind(0)), kind, longest, threads)


def buffer_floats(N: int, H: int, Hkv: int, D: int, longest: int, threads: int
                  ) -> tuple[int, list[int]]:
    """(the parts of the longest sequence, cmax; the floats of `attend`'s buffers in its
    arguments' order: qbuf, tmp, sbufs, obufs, mbufs, lbufs)."""
    G = H // Hkv
    cmax = (longest + PART_KEYS - 1) // PART_KEYS
    parts = N * Hkv * cmax * G  # (sequence, KV head, part, query head)
    return cmax, [N * H * D, D, threads * G * PART_KEYS, parts * D, parts, parts]


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor,
           table: torch.Tensor, H: int, Hkv: int, D: int, half: bool, kind: int, longest: int,
           threads: int, eps: float, scale: float) -> torch.Tensor:
    """qkv [N, (H + 2 Hkv) * D] float32 (a decode pass's product, one row a sequence),
    cos, sin [N, D] float32 (`RopeSpec.rotation`'s, sin signed), qk_norm [H + Hkv, D]
    float32 or empty; `table` one layer's of a `Plan` (and its kind, longest, threads):
    each sequence's key and value are written into its copy and its queries attend
    -> [N, H * D] float32, query head h at columns h * D."""
    k = int8_products.kernel()
    if k is None:
        raise RuntimeError(f"The decode attention kernel is not available: {int8_products.unavailable_reason()}")
    N = qkv.shape[0]
    if not (qkv.dtype == torch.float32 and qkv.is_contiguous() and qkv.dim() == 2
            and qkv.shape[1] == (H + 2 * Hkv) * D and fits(D) and Hkv > 0 and H % Hkv == 0
            and H // Hkv <= MAX_GROUP):
        raise ValueError("decode_attention: qkv must be float32 [N, (H + 2 Hkv) * D], D a multiple of 32")
    if not (cos.dtype == sin.dtype == torch.float32 and cos.numel() == sin.numel() == N * D
            and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("decode_attention: cos and sin must be float32 [N, D]")
    has_norm = qk_norm.numel() > 0
    if has_norm and not (qk_norm.dtype == torch.float32 and qk_norm.is_contiguous()
                         and qk_norm.numel() == (H + Hkv) * D):
        raise ValueError("decode_attention: qk_norm must be float32 [H + Hkv, D]")
    if not (table.dtype == torch.int64 and table.is_contiguous() and table.shape == (N, _SEQ_FIELDS)
            and kind in _KIND_NAMES and longest >= 1 and threads >= 1):
        raise ValueError("decode_attention: a table [N, 7] from `decode_attention.plan`")
    cmax, sizes = buffer_floats(N, H, Hkv, D, longest, threads)
    at = [int8_products._scratch(4 * sum(sizes)).data_ptr()]
    for size in sizes[:-1]:  # where each buffer starts
        at.append(at[-1] + 4 * size)
    out = torch.empty(N, H * D, dtype=torch.float32)
    k.attend(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qk_norm.data_ptr() if has_norm else 0,
             int(has_norm), eps, table.data_ptr(), N, H, Hkv, D, int(half), kind, scale,
             at[0], at[1], at[2], cmax, at[3], at[4], at[5], out.data_ptr(), threads)
    return out


def reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor,
              datas: list[torch.Tensor], layer: int, starts: list[int], firsts: list[int],
              seens: list[int], H: int, Hkv: int, D: int, half: bool, eps: float,
              scale: float) -> torch.Tensor:
    """`attend` in float64 torch operations, for tests: it writes the copies as `attend` does
    (rounded to their dtype) and returns the attention in float64."""
    N = qkv.shape[0]
    G = H // Hkv
    outs = []
    for i in range(N):
        row = qkv[i].double().view(H + 2 * Hkv, D)
        qk, v = row[:H + Hkv], row[H + Hkv:]
        if qk_norm.numel():
            qk = qk / torch.sqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * qk_norm.double()
        swap = torch.arange(D).roll(D // 2) if half else torch.arange(D) ^ 1
        qk = qk * cos.reshape(N, D)[i].double() + qk[:, swap] * sin.reshape(N, D)[i].double()
        both = datas[i][layer]
        both[0, :, starts[i]] = qk[H:].to(both.dtype)
        both[1, :, starts[i]] = v.to(both.dtype)
        keys = both[0, :, firsts[i]:firsts[i] + seens[i]].double()
        values = both[1, :, firsts[i]:firsts[i] + seens[i]].double()
        q = qk[:H] * scale
        heads = []
        for h in range(H):
            scores = keys[h // G] @ q[h]
            heads.append(torch.softmax(scores, -1) @ values[h // G])
        outs.append(torch.cat(heads))
    return torch.stack(outs)


# The call as a torch operator, for TorchScript (`app.models.decode_step`).
_LIBRARY = torch.library.Library("ferrox", "FRAGMENT")
_LIBRARY.define("decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor qk_norm, Tensor table, "
                "int H, int Hkv, int D, bool half, int kind, int longest, int threads, float eps, "
                "float scale) -> Tensor")
_LIBRARY.impl("decode_attention", attend, "CPU")

