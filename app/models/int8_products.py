"""Products of 4-bit and 5-bit weights with activations quantized to 8 bits, compiled for
this CPU at run time.

torch's CPU kernel for 4-bit weights (`aten._weight_int4pack_mm_for_cpu`) turns every code
into a float and multiplies in floating point; llama.cpp instead quantizes the activations
to 8 bits per block of 32 and multiplies integers, 32 products in two instructions on AVX2
(`vpmaddubsw`, `vpmaddwd`). torch ships no such kernel, and a C compiler cannot be assumed on
a user's machine. LLVM can: llvmlite (numba's binding, wheels for every platform) carries it.
So this module writes the kernel as LLVM IR, compiles it once a process for the CPU torch
itself runs on (its AVX2 kernels, or AVX-512's), and runs it on torch's own OpenMP threads:
the kernel calls libgomp's `GOMP_parallel` from the library torch loaded, so no second pool
competes with torch's for the cores. Measured on a 2-core Xeon with torch's AVX2 kernels,
one row: SmolLM2's 3072 x 576 gate-up 86 -> 37 us, Gemma 3's 640 x 2048 down 84 -> 37 us.

The arithmetic, for output n and row r of x [M, K], with blocks of 32 inputs:

    x_i  ~  dx * xq_i        xq_i = round(x_i / dx) in -127..127, dx = max |x_i| / 127
    w_i  =  s * c_i + b      c_i the weight's code (0..15, or a signed byte)

    y[r, n] = sum over blocks of  s * dx * (sum_i c_i * xq_i)  +  b * dx * (sum_i xq_i)

that is, the exact product of the weight with x rounded to 8 bits, whose error is
sum_i w_i * (x_i - dx * xq_i). The integer sums are exact. (The offsets' term with x's exact
sum instead would leave an error of s * sum_i c_i * (x_i - dx * xq_i), with codes 0..15
against weights centred on zero: measured on Gemma 3's Q8_0 rows, ~4x the error.) Per output
and row every float operation is the same whatever else is in the product -- one row's
accumulator, the blocks in one order -- so a row's result does not depend on how many rows,
or which, share the call: batching changes no bit.

Layouts (`Int8Codes`), as each output's codes run before the interleaving below: blocks in
input order, planes one after the other:
  NIBBLES  16 bytes per block: byte j holds code j in its low nibble and code 16 + j in its
           high one (GGUF's Q4_0 and Q4_1 store their codes this way), so a 32-byte vector
           of 8 outputs' 4 bytes gives two sets of 4 inputs, used as it is loaded (a layout
           pairing two blocks' codes in a byte had kept 8 vectors live across a block, which
           LLVM spilled: 4 rows of x, one thread, 2-core AMD EPYC, SmolLM2's gate-up 104-110
           -> 93-95 us, its down 58-61 -> 54);
  BYTES    32 bytes per block, one signed code a byte (Q8_0's own; and 5-bit codes where
           they join a Q8_0 weight in one product). `vpmaddubsw` multiplies unsigned by
           signed bytes, so it takes |c| and x with c's sign (`vpsignb`, as llama.cpp
           does): pairs of products then stay within 2 * 128 * 127, short of saturating
           16 bits.
  FIVES    40 bytes per pair of blocks, 5-bit codes 0..31 (Q5_0, Q5_1, Q5_K's): the pair's
           low 4 bits, byte j holding block A's code j in its low nibble and B's in its
           high one, then A's fifth bits, then B's, sliced so that one shift and one mask
           put any 4 inputs' fifth bits of 8 outputs in place (below): 5.5 bits a code
           where BYTES took 8 (Gemma 3 270M's Q5_0 products read ~1/3 fewer bytes a decode
           step). The same products as BYTES, bit for bit.
Scales and offsets are float16 [N, planes * nb], nb the blocks of a plane: as many bytes as
torch's kernel reads for its bfloat16 scales and zeros, and exact for the blocks' own float16
scales (a Q4_K scale d * sc rounds to float16, 1/2048 of itself at most). A decode step reads
every weight from memory, and float32 scales padded to 8 blocks had cost 67% more bytes than
the codes of SmolLM2's 576-wide rows. A weight may be several planes, summed in the same
accumulators, each against the same x (`nibble_codes`); every GGUF type fits one today.

Every tensor is stored interleaved by groups of 8 outputs (`GROUP_OUTPUTS`; N a multiple of
8): within a group, the 8 rows' first 4 code bytes, then their next 4, ... (FIVES: for each
pair of blocks: for each 4 inputs q the 8 outputs' 4 nibble bytes, then block A's fifth
bits as 32 bytes, byte 4o + i holding output o's input 4q + i in bit q, then B's; spread
one a byte, 4 bytes a q, they had taken a broadcast, a shuffle, two masks and a compare),
and each block's 8 scales (offsets) side by side. One 32-byte vector then holds 4 inputs
of 8 outputs (NIBBLES: twice, in its low and high nibbles), one output a 32-bit lane: x's
4 bytes broadcast against it sum into each output's lane, a whole block's sum in one
vector after 8 of them, so a block costs one convert, one scale multiply and one
multiply-add for 8 outputs (stored output by output, AVX2 had taken those for every output, plus a sum of 8
lanes at the end). Four rows of x are bound by that arithmetic, not the memory: SmolLM2's
3072 x 576 gate-up, four rows, cache-resident, 111-115 -> 63-70 us on a 2-core AMD EPYC
(one row 50-52 -> 30-33 us). A tensor keeps its [N, ...] shape, so whole groups of outputs
still slice and join as rows (`layers.fuse`, `cat_rows`); `logical_codes` and
`logical_scales` read one back output by output.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from app.models.errors import ModelError

log = logging.getLogger(__name__)

GROUP = 32
NIBBLES = 0
BYTES = 1
FIVES = 2
LAYOUTS = (NIBBLES, BYTES, FIVES)
_CODE_BYTES = {NIBBLES: 16, BYTES: 32, FIVES: 20}  # bytes a block of 32 codes takes
# Outputs a tile computes together, one in each 32-bit lane of AVX2's vectors: the codes of
# each group of 8 output rows are stored interleaved (see the module docstring).
GROUP_OUTPUTS = 8
# Rows of x one call's tiles hold at once: each row has an accumulator and a running sum
# (AVX2 has 16 vector registers, and a block's 8 code vectors use some).
_TILE_ROWS = 4
# Bytes of the scratch a block of x takes (`_scratch_bytes`): its 32 rounded values, its
# scale in 8 lanes and its sum.
_SCRATCH_BLOCK_BYTES = GROUP + 4 * 8 + 4
# Bytes of x's scratch every thread asks for as its share of a product starts (`_work_ir`).
_X_PREFETCH_BYTES = 32768


@dataclass(frozen=True)
class Int8Codes:
    """A weight [N, K] for `matmul`: codes uint8 (int8 for BYTES) [N, planes * K / 32 * code
    bytes], scales and offsets float16 [N, planes * K / 32] (see the module docstring)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    layout: int
    planes: int = 1


def fits(k: int) -> bool:
    """Whether K inputs can be multiplied here: whole pairs of blocks."""
    return k > 0 and k % (2 * GROUP) == 0


# ---- the kernel's IR ---------------------------------------------------------------------

_HEADER = """
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare float @llvm.fma.f32(float, float, float)
declare float @llvm.sqrt.f32(float)
declare <8 x float> @llvm.fabs.v8f32(<8 x float>)
declare <8 x float> @llvm.maxnum.v8f32(<8 x float>, <8 x float>)
declare <4 x float> @llvm.maxnum.v4f32(<4 x float>, <4 x float>)
declare <2 x float> @llvm.maxnum.v2f32(<2 x float>, <2 x float>)
declare float @llvm.maxnum.f32(float, float)
declare <8 x float> @llvm.rint.v8f32(<8 x float>)
declare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)
declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)
declare <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32>, <8 x i32>, <8 x i32>)
%args = type { ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64 }
"""

_SEQ32 = ", ".join(f"i32 {i}" for i in range(32))
_SEQ16 = ", ".join(f"i32 {i}" for i in range(16))


def sum8_ir(v: str, out: str, name: str) -> list[str]:
    """IR for float `out` = the lanes of <8 x float> `v` summed as a fixed tree."""
    return [
        f"  %{name}a = shufflevector <8 x float> {v}, <8 x float> poison, <4 x i32> <i32 0, i32 1, i32 2, i32 3>",
        f"  %{name}b = shufflevector <8 x float> {v}, <8 x float> poison, <4 x i32> <i32 4, i32 5, i32 6, i32 7>",
        f"  %{name}4 = fadd <4 x float> %{name}a, %{name}b",
        f"  %{name}c = shufflevector <4 x float> %{name}4, <4 x float> poison, <2 x i32> <i32 0, i32 1>",
        f"  %{name}d = shufflevector <4 x float> %{name}4, <4 x float> poison, <2 x i32> <i32 2, i32 3>",
        f"  %{name}2 = fadd <2 x float> %{name}c, %{name}d",
        f"  %{name}e = extractelement <2 x float> %{name}2, i32 0",
        f"  %{name}f = extractelement <2 x float> %{name}2, i32 1",
        f"  {out} = fadd float %{name}e, %{name}f",
    ]


def inverse_rms_ir(row: str, blocks: str, width: str, eps: str, pred: str, tag: str) -> list[str]:
    """IR from block %`pred` on: 1 / sqrt(mean(row^2) + eps) over `blocks` blocks of 32
    floats at ptr `row` (`width`: their count, a float value), as float %<tag>_inv and
    <8 x float> %<tag>_iv, ending in block %<tag>_done, where the caller goes on. The
    squares are summed in 4 accumulators of 8 lanes (a block's 4 vectors), then a fixed tree."""
    t = tag
    L = [f"  br label %{t}_sq", f"{t}_sq:", f"  %{t}_i = phi i64 [0, %{pred}], [%{t}_in, %{t}_sq]"]
    L += [f"  %{t}_a{c} = phi <8 x float> [zeroinitializer, %{pred}], [%{t}_an{c}, %{t}_sq]" for c in range(4)]
    L += [f"  %{t}_o = shl i64 %{t}_i, 5"]
    for c in range(4):
        L += [f"  %{t}_o{c} = add i64 %{t}_o, {8 * c}",
              f"  %{t}_p{c} = getelementptr float, ptr {row}, i64 %{t}_o{c}",
              f"  %{t}_v{c} = load <8 x float>, ptr %{t}_p{c}, align 4",
              f"  %{t}_an{c} = call <8 x float> @llvm.fma.v8f32(<8 x float> %{t}_v{c}, <8 x float> %{t}_v{c}, <8 x float> %{t}_a{c})"]
    L += [f"  %{t}_in = add i64 %{t}_i, 1", f"  %{t}_more = icmp ult i64 %{t}_in, {blocks}",
          f"  br i1 %{t}_more, label %{t}_sq, label %{t}_done",
          f"{t}_done:",
          f"  %{t}_s01 = fadd <8 x float> %{t}_an0, %{t}_an1", f"  %{t}_s23 = fadd <8 x float> %{t}_an2, %{t}_an3",
          f"  %{t}_s = fadd <8 x float> %{t}_s01, %{t}_s23"]
    L += sum8_ir(f"%{t}_s", f"%{t}_sum", f"{t}_t")
    L += [f"  %{t}_mean = fdiv float %{t}_sum, {width}", f"  %{t}_meps = fadd float %{t}_mean, {eps}",
          f"  %{t}_rt = call float @llvm.sqrt.f32(float %{t}_meps)", f"  %{t}_inv = fdiv float 1.0, %{t}_rt",
          f"  %{t}_iv0 = insertelement <8 x float> poison, float %{t}_inv, i32 0",
          f"  %{t}_iv = shufflevector <8 x float> %{t}_iv0, <8 x float> poison, <8 x i32> zeroinitializer"]
    return L


def _quantize_ir(bf16: bool, normed: bool = False) -> str:
    """quantize_<f32|bf16>(x, xq, dx, xs, M, nb): every block of 32 of x [M, nb * 32]
    -> xq int8, dx = max |x| / 127 (float32 [M, nb, 8]: each block's repeated in 8 lanes, so
    a product's tile multiplies it into a weight's scale with one vector instruction, no
    broadcast of its own) and xs = dx * sum xq (float32 [M, nb]).
    quantize_normed(x, w, eps, ...): the same of x's RMS norm, x float32: each row times
    1 / sqrt(mean(x^2) + eps), then times w [nb * 32] (the product's pre-norm folded in, so
    a decode step runs no norm of its own: `matmul`'s `norm`)."""
    name = "quantize_normed" if normed else "quantize_bf16" if bf16 else "quantize_f32"
    loads = []
    for c in range(4):
        if bf16:
            loads += [f"  %p{c} = getelementptr i16, ptr %x, i64 %xo{c}",
                      f"  %h{c} = load <8 x i16>, ptr %p{c}, align 2",
                      f"  %w{c} = zext <8 x i16> %h{c} to <8 x i32>",
                      f"  %u{c} = shl <8 x i32> %w{c}, splat (i32 16)",
                      f"  %v{c} = bitcast <8 x i32> %u{c} to <8 x float>"]
        elif normed:
            loads += [f"  %p{c} = getelementptr float, ptr %x, i64 %xo{c}",
                      f"  %x{c} = load <8 x float>, ptr %p{c}, align 4",
                      f"  %nx{c} = fmul <8 x float> %x{c}, %sq_iv",
                      f"  %wi{c} = add i64 %wo, {8 * c}",
                      f"  %wp{c} = getelementptr float, ptr %nw, i64 %wi{c}",
                      f"  %wv{c} = load <8 x float>, ptr %wp{c}, align 4",
                      f"  %v{c} = fmul <8 x float> %nx{c}, %wv{c}"]
        else:
            loads += [f"  %p{c} = getelementptr float, ptr %x, i64 %xo{c}",
                      f"  %v{c} = load <8 x float>, ptr %p{c}, align 4"]
    if normed:
        # per row first: r = 1 / sqrt(sum of squares / K + eps)
        head = ["define internal void @quantize_normed(ptr %x, ptr %nw, float %eps, ptr %xq, ptr %dx, "
                "ptr %xs, i64 %M, i64 %nb) {",
                "entry:",
                "  %K = mul i64 %nb, 32",
                "  %Kf = uitofp i64 %K to float",
                "  br label %row",
                "row:", "  %r = phi i64 [0, %entry], [%rn, %row_end]",
                "  %rk = mul i64 %r, %K",
                "  %xr = getelementptr float, ptr %x, i64 %rk"]
        head += inverse_rms_ir("%xr", "%nb", "%Kf", "%eps", "row", "sq")
        head += ["  br label %blk",
                 "blk:", "  %i = phi i64 [0, %sq_done], [%in, %blk]",
                 "  %wo = mul i64 %i, 32"]
        body = head
    else:
        body = [f"define internal void @{name}(ptr %x, ptr %xq, ptr %dx, ptr %xs, i64 %M, i64 %nb) {{",
                "entry:", "  br label %row",
                "row:", "  %r = phi i64 [0, %entry], [%rn, %row_end]", "  br label %blk",
                "blk:", "  %i = phi i64 [0, %row], [%in, %blk]"]
    body += ["  %rb = mul i64 %r, %nb", "  %gi = add i64 %rb, %i", "  %xo = mul i64 %gi, 32"]
    body += [f"  %xo{c} = add i64 %xo, {8 * c}" for c in range(4)]
    body += loads
    body += [f"  %a{c} = call <8 x float> @llvm.fabs.v8f32(<8 x float> %v{c})" for c in range(4)]
    body += [
        "  %m01 = call <8 x float> @llvm.maxnum.v8f32(<8 x float> %a0, <8 x float> %a1)",
        "  %m23 = call <8 x float> @llvm.maxnum.v8f32(<8 x float> %a2, <8 x float> %a3)",
        "  %m = call <8 x float> @llvm.maxnum.v8f32(<8 x float> %m01, <8 x float> %m23)",
        "  %ma = shufflevector <8 x float> %m, <8 x float> poison, <4 x i32> <i32 0, i32 1, i32 2, i32 3>",
        "  %mb = shufflevector <8 x float> %m, <8 x float> poison, <4 x i32> <i32 4, i32 5, i32 6, i32 7>",
        "  %m4 = call <4 x float> @llvm.maxnum.v4f32(<4 x float> %ma, <4 x float> %mb)",
        "  %mc = shufflevector <4 x float> %m4, <4 x float> poison, <2 x i32> <i32 0, i32 1>",
        "  %md = shufflevector <4 x float> %m4, <4 x float> poison, <2 x i32> <i32 2, i32 3>",
        "  %m2 = call <2 x float> @llvm.maxnum.v2f32(<2 x float> %mc, <2 x float> %md)",
        "  %me = extractelement <2 x float> %m2, i32 0",
        "  %mf = extractelement <2 x float> %m2, i32 1",
        "  %amax = call float @llvm.maxnum.f32(float %me, float %mf)",
        "  %d = fdiv float %amax, 127.0",
        "  %nz = fcmp ogt float %amax, 0.0",
        "  %inv0 = fdiv float 127.0, %amax",
        "  %inv = select i1 %nz, float %inv0, float 0.0",
        "  %iv0 = insertelement <8 x float> poison, float %inv, i32 0",
        "  %iv = shufflevector <8 x float> %iv0, <8 x float> poison, <8 x i32> zeroinitializer",
    ]
    for c in range(4):
        body += [f"  %s{c} = fmul <8 x float> %v{c}, %iv",
                 f"  %r{c} = call <8 x float> @llvm.rint.v8f32(<8 x float> %s{c})",
                 f"  %q{c} = fptosi <8 x float> %r{c} to <8 x i8>"]
    body += [
        f"  %q01 = shufflevector <8 x i8> %q0, <8 x i8> %q1, <16 x i32> <{_SEQ16}>",
        f"  %q23 = shufflevector <8 x i8> %q2, <8 x i8> %q3, <16 x i32> <{_SEQ16}>",
        f"  %q = shufflevector <16 x i8> %q01, <16 x i8> %q23, <32 x i32> <{_SEQ32}>",
        "  %qp = getelementptr i8, ptr %xq, i64 %xo",
        "  store <32 x i8> %q, ptr %qp, align 1",
        "  %sum01 = fadd <8 x float> %r0, %r1",  # whole numbers: exact sums
        "  %sum23 = fadd <8 x float> %r2, %r3",
        "  %sum = fadd <8 x float> %sum01, %sum23",
    ]
    body += sum8_ir("%sum", "%qsum", "t")
    body += ["  %ssum = fmul float %qsum, %d"]
    body += [
        "  %dv0 = insertelement <8 x float> poison, float %d, i32 0",
        "  %dv = shufflevector <8 x float> %dv0, <8 x float> poison, <8 x i32> zeroinitializer",
        "  %dpp = getelementptr <8 x float>, ptr %dx, i64 %gi", "  store <8 x float> %dv, ptr %dpp, align 4",
        "  %xsp = getelementptr float, ptr %xs, i64 %gi", "  store float %ssum, ptr %xsp, align 4",
        "  %in = add i64 %i, 1", "  %bmore = icmp ult i64 %in, %nb",
        "  br i1 %bmore, label %blk, label %row_end",
        "row_end:", "  %rn = add i64 %r, 1", "  %rmore = icmp ult i64 %rn, %M",
        "  br i1 %rmore, label %row, label %out",
        "out:", "  ret void", "}",
    ]
    return "\n".join(body)


def _tile_ir(layout: int, rows: int, vnni: bool) -> str:
    """tile(codes, s, b, xq, dx, xs, y, nb, N, planes, r0, g): y[r0 .. r0 + rows,
    8g .. 8g + 8], the outputs of group g, one in each 32-bit lane. Per block and row, the
    block's whole integer sum for all 8 outputs (8 broadcasts of 4 of x's bytes, each
    against the 8 outputs' 4 codes), one convert, one multiply by the scales, one
    multiply-add into the row's accumulator; the offsets' term into it right after. Each
    row has one accumulator, its blocks in order, so its floats are the same in any tile.
    Then stored, 8 floats a row: no lanes to sum."""
    L: list[str] = []
    a = L.append
    bpb = _CODE_BYTES[layout]
    G = GROUP_OUTPUTS
    a(f"define internal void @tile_{layout}_{rows}(ptr %codes, ptr %s, ptr %b, ptr %xq, ptr %dx, "
      "ptr %xs, ptr %y, i64 %nb, i64 %N, i64 %planes, i64 %r0, i64 %g) {")
    a("entry:")
    a(f"  %plane_bytes = mul i64 %nb, {bpb * G}")  # a group's plane: 8 outputs' codes
    a("  %group_bytes = mul i64 %plane_bytes, %planes")
    a(f"  %group_scales = mul i64 %nb, {G}")
    a("  %group_scales_all = mul i64 %group_scales, %planes")
    a("  %cgo = mul i64 %g, %group_bytes")
    a("  %cg = getelementptr i8, ptr %codes, i64 %cgo")
    a("  %sgo = mul i64 %g, %group_scales_all")
    a("  %sg = getelementptr half, ptr %s, i64 %sgo")
    a("  %bg = getelementptr half, ptr %b, i64 %sgo")
    for r in range(rows):
        a(f"  %rr{r} = add i64 %r0, {r}")
        a(f"  %xr{r} = mul i64 %rr{r}, %nb")
        a(f"  %xb{r} = mul i64 %xr{r}, 32")
        a(f"  %xp{r} = getelementptr i8, ptr %xq, i64 %xb{r}")
        a(f"  %dp{r} = getelementptr <8 x float>, ptr %dx, i64 %xr{r}")
        a(f"  %xsp{r} = getelementptr float, ptr %xs, i64 %xr{r}")
    # (No prefetch of the next group's codes: the hardware's stream prefetchers follow a
    # thread's run of groups. Asking for each group's next one cost 5-10% of a product
    # cache-resident and measured no gain from memory: in the engine, alternating, Gemma 3
    # 270M's four streams 260-271 -> 280-289 tok/s, SmolLM2's within the host's noise.)
    a("  br label %plane")
    a("plane:")
    a("  %p = phi i64 [0, %entry], [%pn, %pair_end]")
    for r in range(rows):
        a(f"  %pa_{r} = phi <8 x float> [zeroinitializer, %entry], [%na_{r}_1, %pair_end]")
    a("  %pcb = mul i64 %p, %plane_bytes")
    a("  %pc = getelementptr i8, ptr %cg, i64 %pcb")
    a("  %psb = mul i64 %p, %group_scales")
    a("  %ps = getelementptr half, ptr %sg, i64 %psb")
    a("  %pb = getelementptr half, ptr %bg, i64 %psb")
    a("  br label %pair")
    a("pair:")
    a("  %blk = phi i64 [0, %plane], [%blkn, %pair]")
    for r in range(rows):
        a(f"  %acc_{r} = phi <8 x float> [%pa_{r}, %plane], [%na_{r}_1, %pair]")
    # The pair's blocks one after the other; within a block, 4 inputs q at a time: the 8
    # outputs' codes there (32 bytes, 4 an output), each row's x there broadcast against
    # them, summed into the row's running sum. Emitted in that order, so a weight vector
    # lives only while the rows use it (all 16 loaded first had spilled registers).
    a(f"  %wo = mul i64 %blk, {bpb * G}")  # the pair starts 2 blocks' codes * 8 outputs in
    a("  %wp = getelementptr i8, ptr %pc, i64 %wo")
    # pairs of products in 16 bits, summed while they cannot overflow: 8 of NIBBLES'
    # (<= 8 * 2 * 15 * 127), 4 of FIVES' (4 * 2 * 31 * 127), 1 of BYTES' (2 * 128 * 127)
    run = {NIBBLES: 8, FIVES: 4, BYTES: 1}[layout]
    for j in range(2):
        a(f"  %bk{j} = add i64 %blk, {j}")
        for r in range(rows):
            a(f"  %xo{r}_{j} = mul i64 %bk{j}, 32")
        sums16 = {r: None for r in range(rows)}
        sums32 = {r: None for r in range(rows)}
        # NIBBLES: vector k of the block holds inputs 4k.. in its low nibbles and 16 + 4k..
        # in its high ones, so both halves are used as it is loaded (one vector live at a
        # time; the integer sums are exact, so their order changes no bit)
        order = (0, 4, 1, 5, 2, 6, 3, 7) if layout == NIBBLES else range(8)
        for pos, q in enumerate(order):
            w = f"%w_{j}_{q}"
            if layout == NIBBLES:
                k = q % 4
                if q < 4:
                    a(f"  %wq{j}_{k}p = getelementptr i8, ptr %wp, i64 {32 * (4 * j + k)}")
                    a(f"  %wv{j}_{k} = load <32 x i8>, ptr %wq{j}_{k}p, align 1")
                    a(f"  {w} = and <32 x i8> %wv{j}_{k}, splat (i8 15)")
                else:
                    a(f"  {w} = lshr <32 x i8> %wv{j}_{k}, splat (i8 4)")
            elif layout == FIVES:
                a(f"  %wq{j}_{q}p = getelementptr i8, ptr %wp, i64 {32 * q}")
                a(f"  %wv{j}_{q} = load <32 x i8>, ptr %wq{j}_{q}p, align 1")
                low = f"%wl_{j}_{q}"
                if j == 0:
                    a(f"  {low} = and <32 x i8> %wv{j}_{q}, splat (i8 15)")
                else:
                    a(f"  {low} = lshr <32 x i8> %wv{j}_{q}, splat (i8 4)")
                # the block's fifth bits, bit q of each byte for these 32 codes: moved to
                # bit 4 by one shift (bit q of a byte only moves within it)
                if q == 0:
                    a(f"  %fbp{j} = getelementptr i8, ptr %wp, i64 {256 + 32 * j}")
                    a(f"  %fb{j} = load <32 x i8>, ptr %fbp{j}, align 1")
                if q < 4:
                    a(f"  %ft_{j}_{q} = shl <32 x i8> %fb{j}, splat (i8 {4 - q})")
                elif q > 4:
                    a(f"  %ft_{j}_{q} = lshr <32 x i8> %fb{j}, splat (i8 {q - 4})")
                ft = f"%ft_{j}_{q}" if q != 4 else f"%fb{j}"
                a(f"  %hz_{j}_{q} = and <32 x i8> {ft}, splat (i8 16)")
                a(f"  {w} = or <32 x i8> {low}, %hz_{j}_{q}")
            else:
                a(f"  %wq{j}_{q}p = getelementptr i8, ptr %wp, i64 {256 * j + 32 * q}")
                a(f"  {w} = load <32 x i8>, ptr %wq{j}_{q}p, align 1")
                a(f"  %wa_{j}_{q} = call <32 x i8> @llvm.abs.v32i8(<32 x i8> {w}, i1 false)")
            for r in range(rows):
                kq = f"{r}_{j}_{q}"
                a(f"  %xo{kq} = add i64 %xo{r}_{j}, {4 * q}")
                a(f"  %xp{kq} = getelementptr i8, ptr %xp{r}, i64 %xo{kq}")
                a(f"  %xi{kq} = load i32, ptr %xp{kq}, align 1")
                a(f"  %xv{kq}0 = insertelement <8 x i32> poison, i32 %xi{kq}, i32 0")
                a(f"  %xv{kq}1 = shufflevector <8 x i32> %xv{kq}0, <8 x i32> poison, <8 x i32> zeroinitializer")
                a(f"  %x{kq} = bitcast <8 x i32> %xv{kq}1 to <32 x i8>")
                if layout in (NIBBLES, FIVES):
                    u, v = w, f"%x{kq}"
                else:  # |c| times x with c's sign
                    a(f"  %xs{kq} = call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> %x{kq}, <32 x i8> {w})")
                    u, v = f"%wa_{j}_{q}", f"%xs{kq}"
                if vnni:  # four products into each 32-bit lane, summed there
                    a(f"  %u32_{kq} = bitcast <32 x i8> {u} to <8 x i32>")
                    a(f"  %v32_{kq} = bitcast <32 x i8> {v} to <8 x i32>")
                    prev = sums32[r] or "zeroinitializer"
                    a(f"  %dp_{kq} = call <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32> {prev}, <8 x i32> %u32_{kq}, <8 x i32> %v32_{kq})")
                    sums32[r] = f"%dp_{kq}"
                    continue
                a(f"  %m_{kq} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u}, <32 x i8> {v})")
                if sums16[r] is None:
                    sums16[r] = f"%m_{kq}"
                else:
                    a(f"  %s16_{kq} = add <16 x i16> {sums16[r]}, %m_{kq}")
                    sums16[r] = f"%s16_{kq}"
                if (pos + 1) % run == 0:  # into 32 bits
                    a(f"  %w32_{kq} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {sums16[r]}, <16 x i16> splat (i16 1))")
                    sums16[r] = None
                    if sums32[r] is None:
                        sums32[r] = f"%w32_{kq}"
                    else:
                        a(f"  %s32_{kq} = add <8 x i32> {sums32[r]}, %w32_{kq}")
                        sums32[r] = f"%s32_{kq}"
        a(f"  %sco{j} = mul i64 %bk{j}, {G}")
        a(f"  %scp{j} = getelementptr half, ptr %ps, i64 %sco{j}")
        a(f"  %sch{j} = load <8 x half>, ptr %scp{j}, align 2")
        a(f"  %sc{j} = fpext <8 x half> %sch{j} to <8 x float>")
        a(f"  %ofp{j} = getelementptr half, ptr %pb, i64 %sco{j}")
        a(f"  %ofh{j} = load <8 x half>, ptr %ofp{j}, align 2")
        a(f"  %of{j} = fpext <8 x half> %ofh{j} to <8 x float>")
        for r in range(rows):
            k = f"{r}_{j}"
            prev = f"%acc_{r}" if j == 0 else f"%na_{r}_0"
            a(f"  %f_{k} = sitofp <8 x i32> {sums32[r]} to <8 x float>")
            a(f"  %dsp_{k} = getelementptr <8 x float>, ptr %dp{r}, i64 %bk{j}")
            a(f"  %ds_{k} = load <8 x float>, ptr %dsp_{k}, align 4")  # x's scale, in 8 lanes
            a(f"  %cv_{k} = fmul <8 x float> %sc{j}, %ds_{k}")
            a(f"  %ma_{k} = call <8 x float> @llvm.fma.v8f32(<8 x float> %cv_{k}, <8 x float> %f_{k}, <8 x float> {prev})")
            # the offsets' term: b * dx * (sum of x's codes), x's sum broadcast
            a(f"  %xssp_{k} = getelementptr float, ptr %xsp{r}, i64 %bk{j}")
            a(f"  %xss_{k} = load float, ptr %xssp_{k}, align 4")
            a(f"  %xsv_{k}0 = insertelement <8 x float> poison, float %xss_{k}, i32 0")
            a(f"  %xsv_{k} = shufflevector <8 x float> %xsv_{k}0, <8 x float> poison, <8 x i32> zeroinitializer")
            a(f"  %na_{k} = call <8 x float> @llvm.fma.v8f32(<8 x float> %of{j}, <8 x float> %xsv_{k}, <8 x float> %ma_{k})")
    a("  %blkn = add i64 %blk, 2")
    a("  %more = icmp ult i64 %blkn, %nb")
    a("  br i1 %more, label %pair, label %pair_end")
    a("pair_end:")
    a("  %pn = add i64 %p, 1")
    a("  %pmore = icmp ult i64 %pn, %planes")
    a("  br i1 %pmore, label %plane, label %done")
    a("done:")
    a(f"  %yc = mul i64 %g, {G}")
    for r in range(rows):
        a(f"  %yo_{r} = mul i64 %rr{r}, %N")
        a(f"  %yo2_{r} = add i64 %yo_{r}, %yc")
        a(f"  %yp_{r} = getelementptr float, ptr %y, i64 %yo2_{r}")
        a(f"  store <8 x float> %na_{r}_1, ptr %yp_{r}, align 4")
    a("  ret void")
    a("}")
    return "\n".join(L)


_FIELDS = ("codes", "s", "b", "xq", "dx", "xs", "y", "nb", "N", "M", "planes", "layout")


def _work_ir() -> str:
    """work(args): this thread's share of the groups of 8 outputs (a run of them), every
    row tile of x over it."""
    L: list[str] = []
    a = L.append
    a("define internal void @work(ptr %argp, i64 %tid, i64 %nth) {")
    a("entry:")
    for i, name in enumerate(_FIELDS):
        ty = "ptr" if i < 7 else "i64"
        a(f"  %{name}p = getelementptr %args, ptr %argp, i32 0, i32 {i}")
        a(f"  %{name} = load {ty}, ptr %{name}p")
    a(f"  %groups = udiv i64 %N, {GROUP_OUTPUTS}")
    a("  %cg1 = add i64 %groups, %nth")
    a("  %cg2 = sub i64 %cg1, 1")
    a("  %chunk = udiv i64 %cg2, %nth")
    a("  %g0a = mul i64 %tid, %chunk")
    a("  %g0lt = icmp ult i64 %g0a, %groups")
    a("  %g0 = select i1 %g0lt, i64 %g0a, i64 %groups")
    a("  %g1a = add i64 %g0, %chunk")
    a("  %g1lt = icmp ult i64 %g1a, %groups")
    a("  %g1 = select i1 %g1lt, i64 %g1a, i64 %groups")
    # x's rounded rows, their scales and sums, asked for at once: the calling thread wrote
    # them, so the other threads' first tile otherwise waits on them a cache line at a time
    # (~2 us of a four-row product). Timed per thread in the engine (SmolLM2, four streams,
    # 2-core AMD EPYC): the helper's share of a step's products 4,344 -> 4,017 us, the
    # caller's wait for it 317 -> 109 us a step. (At most _X_PREFETCH_BYTES: the first
    # tiles' share of a product of many rows.)
    a("  %pfb0 = mul i64 %M, %nb")
    a(f"  %pfb1 = mul i64 %pfb0, {_SCRATCH_BLOCK_BYTES}")
    a(f"  %pfbig = icmp ugt i64 %pfb1, {_X_PREFETCH_BYTES}")
    a(f"  %pfb = select i1 %pfbig, i64 {_X_PREFETCH_BYTES}, i64 %pfb1")
    a("  br label %pfx")
    a("pfx:")
    a("  %pfo = phi i64 [0, %entry], [%pfon, %pfx]")
    a("  %pfp = getelementptr i8, ptr %xq, i64 %pfo")
    a("  call void @llvm.prefetch.p0(ptr %pfp, i32 0, i32 3, i32 1)")
    a("  %pfon = add i64 %pfo, 64")
    a("  %pfm = icmp ult i64 %pfon, %pfb")
    a("  br i1 %pfm, label %pfx, label %pfdone")
    a("pfdone:")
    a("  br label %rows")
    a("rows:")
    a("  %r0 = phi i64 [0, %pfdone], [%r0n, %rows_next]")
    a("  %left = sub i64 %M, %r0")
    a(f"  %big = icmp uge i64 %left, {_TILE_ROWS}")
    a(f"  %R = select i1 %big, i64 {_TILE_ROWS}, i64 %left")
    a("  %Rl = mul i64 %layout, 8")
    a("  %sel = add i64 %Rl, %R")
    cases = " ".join(f"i64 {layout * 8 + R}, label %t{layout}_{R}"
                     for layout in LAYOUTS for R in range(1, _TILE_ROWS + 1))
    a(f"  switch i64 %sel, label %rows_next [ {cases} ]")
    args = "ptr %codes, ptr %s, ptr %b, ptr %xq, ptr %dx, ptr %xs, ptr %y, i64 %nb, i64 %N, i64 %planes, i64 %r0"
    for layout in LAYOUTS:
        for R in range(1, _TILE_ROWS + 1):
            k = f"{layout}_{R}"
            a(f"t{k}:")
            a(f"  br label %l{k}")
            a(f"l{k}:")
            a(f"  %g_{k} = phi i64 [%g0, %t{k}], [%gn_{k}, %body{k}]")
            a(f"  %in_{k} = icmp ult i64 %g_{k}, %g1")
            a(f"  br i1 %in_{k}, label %body{k}, label %rows_next")
            a(f"body{k}:")
            a(f"  call void @tile_{layout}_{R}({args}, i64 %g_{k})")
            a(f"  %gn_{k} = add i64 %g_{k}, 1")
            a(f"  br label %l{k}")
    a("rows_next:")
    a(f"  %r0n = add i64 %r0, {_TILE_ROWS}")
    a("  %rmore = icmp ult i64 %r0n, %M")
    a("  br i1 %rmore, label %rows, label %fin")
    a("fin:")
    a("  ret void")
    a("}")
    return "\n".join(L)


_OPENMP_DECLARATIONS = """
declare i32 @omp_get_thread_num()
declare i32 @omp_get_num_threads()
declare void @GOMP_parallel(ptr, ptr, i32, i32)
"""


def parallel_ir(threaded: bool, work: str, body: str) -> tuple[str, list[str]]:
    """(definitions, the call) that run @`work`(args, tid, nth) on torch's OpenMP pool
    through a body function @`body` when `threaded`, else on the calling thread; the call
    takes the arguments' struct in %a and the threads in %threads."""
    if not threaded:
        return "", [f"  call void @{work}(ptr %a, i64 0, i64 1)"]
    definition = f"""
define internal void @{body}(ptr %argp) {{
entry:
  %t = call i32 @omp_get_thread_num()
  %n = call i32 @omp_get_num_threads()
  %t64 = zext i32 %t to i64
  %n64 = zext i32 %n to i64
  call void @{work}(ptr %argp, i64 %t64, i64 %n64)
  ret void
}}
"""
    return definition, [f"  call void @GOMP_parallel(ptr @{body}, ptr %a, i32 %threads, i32 0)"]


def _driver_ir(threaded: bool) -> str:
    """matmul(x, bf16, norm, eps, codes, s, b, scratch, y, M, N, nb, planes, layout, threads):
    quantize x (or x's RMS norm times `norm`, where `norm` is not null) on the calling thread, then every thread's share of the outputs (on torch's
    OpenMP pool when `threaded`)."""
    stores = []
    values = ["%codes", "%s", "%b", "%xq", "%dx", "%xs", "%y", "%nb", "%N", "%M",
              "%planes", "%layout"]
    for i, v in enumerate(values):
        ty = "ptr" if i < 7 else "i64"
        stores += [f"  %f{i} = getelementptr %args, ptr %a, i32 0, i32 {i}",
                   f"  store {ty} {v}, ptr %f{i}"]
    extra, run = parallel_ir(threaded, "work", "omp_body")
    if threaded:  # (declared once for the module: app.models.decode_attention calls them too)
        extra = _OPENMP_DECLARATIONS + extra
    return extra + "\n".join([
        "define void @matmul(ptr %x, i64 %bf16, ptr %norm, float %eps, ptr %codes, ptr %s, ptr %b, "
        "ptr %scratch, ptr %y, i64 %M, i64 %N, i64 %nb, i64 %planes, i64 %layout, i32 %threads) {",
        "entry:",
        "  %xq = getelementptr i8, ptr %scratch, i64 0",
        "  %qbytes0 = mul i64 %M, %nb",
        "  %qbytes = mul i64 %qbytes0, 32",
        "  %dx = getelementptr i8, ptr %scratch, i64 %qbytes",
        "  %fl0 = mul i64 %M, %nb",
        "  %fl = mul i64 %fl0, 32",
        "  %dxb = add i64 %qbytes, %fl",
        "  %xs = getelementptr i8, ptr %scratch, i64 %dxb",
        "  %isnorm = icmp ne ptr %norm, null",
        "  br i1 %isnorm, label %qn, label %qplain",
        "qn:",
        "  call void @quantize_normed(ptr %x, ptr %norm, float %eps, ptr %xq, ptr %dx, ptr %xs, i64 %M, i64 %nb)",
        "  br label %go",
        "qplain:",
        "  %isbf = icmp ne i64 %bf16, 0",
        "  br i1 %isbf, label %qbf, label %qf",
        "qbf:",
        "  call void @quantize_bf16(ptr %x, ptr %xq, ptr %dx, ptr %xs, i64 %M, i64 %nb)",
        "  br label %go",
        "qf:",
        "  call void @quantize_f32(ptr %x, ptr %xq, ptr %dx, ptr %xs, i64 %M, i64 %nb)",
        "  br label %go",
        "go:",
        "  %a = alloca %args",
        *stores,
        *run,
        "  ret void",
        "}",
    ])


def kernel_ir(threaded: bool, vnni: bool = False) -> str:
    """The kernel's module: `vnni` for CPUs with AVX-512 VNNI (or AVX-VNNI), whose `vpdpbusd`
    sums four byte products into each 32-bit lane in one instruction."""
    parts = [_HEADER, _quantize_ir(False), _quantize_ir(True), _quantize_ir(False, normed=True)]
    for layout in LAYOUTS:
        for rows in range(1, _TILE_ROWS + 1):
            parts.append(_tile_ir(layout, rows, vnni))
    parts += [_work_ir(), _driver_ir(threaded)]
    module = "\n".join(parts)
    # The decode step's attention (app.models.decode_attention), its whole layer
    # (app.models.decode_block) and a screened head's exact logits (app.models.head_rescoring)
    # share the module: one compile, one cache entry, the same threads.
    from app.models.decode_attention import attention_ir
    from app.models.decode_block import block_ir
    from app.models.head_rescoring import rescoring_ir

    module += "\n" + attention_ir(threaded, module)
    module += "\n" + rescoring_ir(threaded, module)
    return module + "\n" + block_ir(module)


# ---- compiling it once a process ------------------------------------------------------------


class _Kernel:
    def __init__(self, fn, attend, rescore, block, select, engine, threaded: bool, isa: str):
        self.fn = fn
        self.attend = attend  # app.models.decode_attention's entry
        self.rescore = rescore  # app.models.head_rescoring's
        self.block = block  # app.models.decode_block's
        self.select = select  # app.models.head_rescoring's candidates
        self.engine = engine  # keeps the machine code alive
        self.threaded = threaded
        self.isa = isa


_kernel: _Kernel | None = None
_kernel_error: str | None = None
_kernel_lock = threading.Lock()


def _target_isa() -> str | None:
    """The instruction set to compile for: torch's own (so a run held to torch's AVX2
    kernels holds this kernel to them too), None where the kernel has no version."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX2":
        return "AVX2"
    if capability.startswith("AVX512"):
        return "AVX512"
    return None


def _openmp_library() -> str | None:
    """The OpenMP runtime torch's own threads run on, when its parallel backend is OpenMP
    and the library lies beside torch (a wheel's libgomp / libomp / libiomp5)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    here = os.path.dirname(torch.__file__)
    for folder in (os.path.join(here, "lib"), os.path.join(os.path.dirname(here), "torch.libs")):
        for pattern in ("libgomp*.so*", "libomp*.so*", "libomp*.dylib", "libiomp5*"):
            found = sorted(glob.glob(os.path.join(folder, pattern)))
            if found:
                return found[0]
    return None


@dataclass(frozen=True)
class _Build:
    """What the kernel is compiled from here, and where its machine code is saved."""

    ir: str
    cpu: str
    cpu_features: str
    threaded: bool
    isa: str  # e.g. "AVX2", "AVX512-VNNI"
    cache: Path | None  # where its machine code is saved (None: no data folder)
    name: str  # that file's name, also in a frozen build's own folder (`_bundled_object`)

    def saved_code(self) -> bytes | None:
        """Its machine code saved by an earlier process, or carried by a frozen build."""
        return _read_object(self.cache) or _bundled_object(self.name)


_irs: dict[tuple[bool, bool], str] = {}  # kernel_ir's text by (threaded, vnni): ~0.15 s to make


def _build_inputs() -> _Build:
    """What the kernel is compiled from for this CPU and torch, and where its machine code
    is saved (raises where it has no version): `_compile` compiles it, `ready` looks for
    its saved machine code."""
    import llvmlite.binding as llvm  # optional at import time: the kernel is a candidate

    isa = _target_isa()
    if isa is None:
        raise RuntimeError(f"no kernel for this CPU ({platform.machine()}, torch "
                           f"{torch.backends.cpu.get_cpu_capability()})")
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features()
    if not all(features.get(f, False) for f in ("avx2", "fma")):
        raise RuntimeError("the CPU has no AVX2 and FMA")
    threaded = False
    library = _openmp_library()
    if library is not None:
        llvm.load_library_permanently(library)
        threaded = all(llvm.address_of_symbol(s) for s in
                       ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads"))
    # VNNI only where torch itself runs its AVX-512 kernels (so a run held to AVX2 is AVX2)
    vnni = isa == "AVX512" and (features.get("avxvnni", False) or (
        features.get("avx512vnni", False) and features.get("avx512vl", False)))
    ir = _irs.get((threaded, vnni))
    if ir is None:
        ir = _irs[threaded, vnni] = kernel_ir(threaded, vnni)
    if isa == "AVX2":  # an AVX2 machine's instructions, whatever this one has beyond them
        cpu, cpu_features = "haswell", ""
    else:
        cpu, cpu_features = llvm.get_host_cpu_name(), features.flatten()
    name = _object_name(ir, cpu, cpu_features, llvm.llvm_version_info)  # (a hash of ~1 MB of IR)
    folder = _object_folder()
    return _Build(ir, cpu, cpu_features, threaded, isa + ("-VNNI" if vnni else ""),
                  folder / name if folder is not None else None, name)


def _compile() -> _Kernel:
    import llvmlite.binding as llvm

    build = _build_inputs()
    module = llvm.parse_assembly(build.ir)
    module.verify()
    target = llvm.Target.from_default_triple()
    machine = target.create_target_machine(cpu=build.cpu, features=build.cpu_features, opt=3)
    cache = build.cache
    cached = build.saved_code()
    if cached is None:  # optimized and compiled (~4 s on a 2-core AMD EPYC); else the saved code
        passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(3))
        passes.getModulePassManager().run(module, passes)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.set_object_cache(lambda _module, code: cached is None and _write_object(cache, code),
                            lambda _module: cached)
    engine.finalize_object()
    address = engine.get_function_address("matmul")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = ctypes.CFUNCTYPE(None, ptr, i64, ptr, ctypes.c_float, ptr, ptr, ptr, ptr, ptr, i64, i64,
                          i64, i64, i64, ctypes.c_int32)(address)
    f32 = ctypes.c_float
    attend = ctypes.CFUNCTYPE(None, ptr, ptr, ptr, ptr, i64, f32, ptr, i64, i64, i64, i64, i64, i64,
                              f32, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_int32)(
        engine.get_function_address("attend"))
    rescore = ctypes.CFUNCTYPE(None, ptr, ptr, i64, ptr, ptr, i64, i64, ptr, ctypes.c_int32)(
        engine.get_function_address("rescore"))
    block = ctypes.CFUNCTYPE(None, ptr, ptr)(engine.get_function_address("block"))
    select = ctypes.CFUNCTYPE(None, ptr, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int32)(
        engine.get_function_address("select_at_least"))
    return _Kernel(fn, attend, rescore, block, select, engine, build.threaded, build.isa)


# Compiled kernels are kept in the data folder, named by everything that shapes their code
# (the IR, the CPU and its features, LLVM's version), with a checksum after the code: a later
# process loads one in ~0.3 s instead of compiling it in ~4 s (2-core AMD EPYC; a window's
# start, a load).
OBJECT_CACHE_DIR = "kernel-cache"
# Where to keep them instead of the data folder: the test suite shares one folder between
# its tests' own data folders (and the processes they start), as it shares the built-in
# models; each compile took ~3.3 s on a 2-core AMD EPYC.
OBJECT_CACHE_ENV = "FERROX_KERNEL_CACHE_DIR"
_CHECKSUM_BYTES = 32


def _object_name(ir: str, cpu: str, features: str, llvm_version) -> str:
    key = hashlib.sha256("\n".join((ir, cpu, features, str(llvm_version))).encode()).hexdigest()
    return f"int8_products-{key[:32]}.o"


def _object_folder() -> Path | None:
    """Where compiled kernels are saved (None: no data folder, compile every time)."""
    try:
        from app.paths import data_dir

        shared = os.environ.get(OBJECT_CACHE_ENV)
        return Path(shared) if shared else data_dir() / OBJECT_CACHE_DIR
    except OSError:
        return None


def _object_path(ir: str, cpu: str, features: str, llvm_version) -> Path | None:
    folder = _object_folder()
    return folder / _object_name(ir, cpu, features, llvm_version) if folder is not None else None


def _bundled_object(name: str) -> bytes | None:
    """The machine code a frozen build carries under this name (its `OBJECT_CACHE_DIR`),
    or None. The build compiles the AVX2 version (`packaging/build.py`): its code is the
    same on every AVX2 machine (compiled for "haswell", no features beyond), so a double-
    click app's first start on one decodes with the kernel before any compile of its own."""
    from app.paths import bundle_dir

    bundle = bundle_dir()
    return _read_object(bundle / OBJECT_CACHE_DIR / name) if bundle is not None else None


def _read_object(path: Path | None) -> bytes | None:
    """The saved machine code at `path`, or None when absent or damaged."""
    try:
        data = path.read_bytes() if path is not None else b""
    except OSError:
        return None
    code, digest = data[:-_CHECKSUM_BYTES], data[-_CHECKSUM_BYTES:]
    return code if code and hashlib.sha256(code).digest() == digest else None


def _write_object(path: Path | None, code: bytes) -> None:
    """Save compiled code (best effort: a full disk or a read-only folder costs a compile at
    the next start, nothing else)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        partial.write_bytes(bytes(code) + hashlib.sha256(bytes(code)).digest())
        os.replace(partial, path)
    except OSError as exc:
        log.info("The compiled kernel was not saved (%s).", exc)


def kernel() -> _Kernel | None:
    """The compiled kernel, or None where it cannot run here (`unavailable_reason`)."""
    global _kernel, _kernel_error
    if _kernel is not None or _kernel_error is not None:
        return _kernel
    with _kernel_lock:
        if _kernel is None and _kernel_error is None:
            try:
                _kernel = _compile()
            except Exception as exc:  # noqa: BLE001 - any failure: the kernel is not a candidate
                _kernel_error = f"{type(exc).__name__}: {exc}"
                log.info("The 8-bit activation kernel is not available (%s).", _kernel_error)
    return _kernel


def available() -> bool:
    """Whether the kernel runs here (compiled now if no earlier process saved it)."""
    return kernel() is not None


def ready() -> bool:
    """Whether the kernel runs here without compiling it now: compiled in this process, or
    its machine code saved by an earlier one or carried by a frozen build (loaded in ~0.3 s
    where compiling takes ~4 s). Never compiles."""
    if _kernel is not None or _kernel_error is not None:
        return _kernel is not None
    try:
        build = _build_inputs()
    except Exception:  # noqa: BLE001 - no kernel for this CPU (`kernel` says why when asked)
        return False
    return build.saved_code() is not None


def unavailable_reason() -> str | None:
    kernel()
    return _kernel_error


# ---- products ---------------------------------------------------------------------------------


def _scratch_bytes(rows: int, k: int) -> int:
    """x's 8-bit rows, then dx (float32 x 8 a block) and xs (float32 a block)."""
    return rows * (k // GROUP) * _SCRATCH_BLOCK_BYTES


_scratches = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's buffer for x's 8-bit rows and block scales (a call uses it while it
    runs, and one thread makes one call at a time): one allocation less a product, ~1 us
    of the ~8 a small product costs around its kernel."""
    buffer = getattr(_scratches, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _scratches.buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buffer


_NO_NORM = torch.empty(0)


def matmul(x: torch.Tensor, w: Int8Codes, norm: torch.Tensor | None = None, eps: float = 0.0
           ) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16; another dtype goes through float32) times the weight
    -> float32 [M, N]. With `norm` (float32 [K]) the product is of x's RMS norm,
    x / sqrt(mean(x^2) + eps) * norm, computed while x is rounded to 8 bits (no norm runs of
    its own: two fewer operations of ~13 us a layer in a small model's decode step)."""
    return _matmul(x, w.codes, w.scales, w.offsets, w.layout, w.planes,
                   _NO_NORM if norm is None else norm, eps)


def _matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
            layout: int, planes: int, norm: torch.Tensor, eps: float) -> torch.Tensor:
    k = kernel()
    if k is None:
        raise RuntimeError(f"The 8-bit activation kernel is not available: {_kernel_error}")
    M, K = x.shape
    N = codes.shape[0]
    nb = K // GROUP
    if not (codes.is_contiguous() and scales.is_contiguous() and offsets.is_contiguous()):
        raise ValueError("int8_products.matmul takes contiguous codes, scales and offsets")
    if not (fits(K) and fits_outputs(N) and layout in _CODE_BYTES and planes >= 1 and scales.shape == offsets.shape == (N, planes * nb)
            and codes.shape == (N, planes * nb * _CODE_BYTES[layout])):
        raise ValueError(f"int8_products.matmul: x [{M}, {K}] does not fit the weight's codes "
                         f"{tuple(codes.shape)} and scales {tuple(scales.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    normed = norm.numel() > 0
    if x.dtype not in (torch.float32, torch.bfloat16) or (normed and x.dtype != torch.float32):
        x = x.float()
    if normed and not (norm.dtype == torch.float32 and norm.is_contiguous() and norm.numel() == K):
        raise ValueError("int8_products.matmul: a norm weight is float32 [K]")
    scratch = _scratch(_scratch_bytes(M, K))
    y = torch.empty(M, N, dtype=torch.float32)
    k.fn(x.data_ptr(), int(x.dtype == torch.bfloat16), norm.data_ptr() if normed else 0, eps,
         codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(), scratch.data_ptr(), y.data_ptr(),
         M, N, nb, planes, layout, torch.get_num_threads())
    return y


# The product as a torch operator, for TorchScript (`app.models.decode_step`): a Python
# kernel behind the dispatcher, ~3 us a call more than calling `matmul`.
_LIBRARY = torch.library.Library("ferrox", "DEF")
_LIBRARY.define("int8_matmul(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int layout, "
                "int planes, Tensor norm, float eps) -> Tensor")
_LIBRARY.impl("int8_matmul", _matmul, "CPU")


# ---- packing ----------------------------------------------------------------------------------


def fits_outputs(n: int) -> bool:
    """Whether N outputs can be stored here: whole groups of `GROUP_OUTPUTS`."""
    return n > 0 and n % GROUP_OUTPUTS == 0


def _check_outputs(n: int) -> None:
    if not fits_outputs(n):
        raise ValueError(f"{n} outputs are not whole groups of {GROUP_OUTPUTS}")


def _interleave(t: torch.Tensor, unit: int) -> torch.Tensor:
    """t [N, R] with each group of 8 rows interleaved `unit` elements at a time: the
    group's first `unit` of row 0, of row 1, ... of row 7, then its second. The same shape,
    so whole groups of rows still slice and join as rows."""
    N, R = t.shape
    _check_outputs(N)
    return t.reshape(N // GROUP_OUTPUTS, GROUP_OUTPUTS, R // unit, unit).transpose(1, 2).reshape(N, R)


def _deinterleave(t: torch.Tensor, unit: int) -> torch.Tensor:
    """`_interleave`'s inverse."""
    N, R = t.shape
    return t.reshape(N // GROUP_OUTPUTS, R // unit, GROUP_OUTPUTS, unit).transpose(1, 2).reshape(N, R)


def _half(values: torch.Tensor) -> torch.Tensor:
    """float32 scales or offsets -> float16 interleaved by groups of outputs, refusing any
    that do not fit float16."""
    half = values.to(torch.float16)
    if not torch.isfinite(half).all():
        raise ModelError("A quantized weight has scales beyond float16's range; the file is "
                         "damaged or was not made for this kind of model.")
    return _interleave(half, 1).contiguous()


def nibble_codes(planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Int8Codes:
    """Planes of (codes uint8 [N, K] in 0..15, scale, offset float32 [N, K / 32]), w = s * c + b
    summed over planes -> NIBBLES codes."""
    parts, scales, offsets = [], [], []
    for codes, s, b in planes:
        N, K = codes.shape
        halves = codes.reshape(N, K // 32, 2, 16)  # per block: codes 0..15, then 16..31
        parts.append((halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(N, K // 2))
        scales.append(s)
        offsets.append(b)
    n = len(planes)
    joined = torch.cat(parts, 1) if n > 1 else parts[0]
    return Int8Codes(_interleave(joined, 4).contiguous(), _half(torch.cat(scales, 1)),
                     _half(torch.cat(offsets, 1)), NIBBLES, n)


def byte_codes(codes: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> Int8Codes:
    """codes int8 [N, K], w = s * c + b -> BYTES codes."""
    return Int8Codes(_interleave(codes, 4).contiguous(), _half(s), _half(b), BYTES, 1)


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def five_codes(codes: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> Int8Codes:
    """codes uint8 [N, K] in 0..31, w = s * c + b -> FIVES codes: for each group of 8
    outputs and pair of blocks, for each 4 inputs q the 8 outputs' low nibbles (block A's
    low, B's high), then block A's fifth bits (byte 4o + i: bit q for output o's input
    4q + i), then B's."""
    N, K = codes.shape
    _check_outputs(N)
    G, P = N // GROUP_OUTPUTS, K // 64
    # [group, output, pair, block, q, i] -> [group, pair, q, block, output, i]
    c = codes.reshape(G, GROUP_OUTPUTS, P, 2, 8, 4).permute(0, 2, 4, 3, 1, 5)
    low = ((c[:, :, :, 0] & 15) | ((c[:, :, :, 1] & 15) << 4)).reshape(G, P, 256)
    bits = ((c >> 4) & 1).reshape(G, P, 8, 2, 32)  # [group, pair, q, block, 4o + i]
    high = (bits * _BIT_WEIGHTS.reshape(8, 1, 1)).sum(2, dtype=torch.uint8).reshape(G, P, 64)
    return Int8Codes(torch.cat((low, high), -1).reshape(N, P * 40).contiguous(),
                     _half(s), _half(b), FIVES, 1)


def logical_codes(w: Int8Codes) -> torch.Tensor:
    """The weight's codes as integers int16 [N, planes, K / 32, 32], output by output."""
    N = w.codes.shape[0]
    if w.layout == NIBBLES:
        raw = _deinterleave(w.codes, 4).reshape(N, w.planes, -1, GROUP // 2)
        return torch.cat((raw & 15, raw >> 4), dim=3).to(torch.int16)
    if w.layout == BYTES:
        return _deinterleave(w.codes, 4).view(torch.int8).reshape(N, w.planes, -1, GROUP).to(torch.int16)
    if w.planes != 1:
        raise ValueError("5-bit codes are one plane")
    G = N // GROUP_OUTPUTS
    t = w.codes.reshape(G, -1, 320)  # [group, pair, 8 x 32 nibble bytes + 2 x 32 fifth bits]
    P = t.shape[1]
    low = t[..., :256].reshape(G, P, 8, 1, GROUP_OUTPUTS, 4)
    high = t[..., 256:].reshape(G, P, 1, 2, GROUP_OUTPUTS, 4)
    fifth = (high >> torch.arange(8, dtype=torch.uint8).reshape(8, 1, 1, 1)) & 1  # bit q
    nibbles = torch.cat((low & 15, low >> 4), 3)  # [group, pair, q, block, output, i]
    c = (nibbles | (fifth << 4)).permute(0, 4, 1, 3, 2, 5)  # [group, output, pair, block, q, i]
    return c.reshape(N, 1, 2 * P, GROUP).to(torch.int16)


def logical_scales(w: Int8Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's (scales, offsets), float16 [N, planes * K / 32], output by output."""
    return _deinterleave(w.scales, 1), _deinterleave(w.offsets, 1)


def as_bytes(w: Int8Codes) -> Int8Codes:
    """FIVES codes as BYTES (the same integers: the same products, bit for bit), so a 5-bit
    weight can join a Q8_0 one in one product (`layers.fuse`)."""
    if w.layout == BYTES:
        return w
    if w.layout != FIVES or w.planes != 1:
        raise ValueError("only 5-bit codes are also bytes")
    codes = logical_codes(w).reshape(w.codes.shape[0], -1).to(torch.int8)
    return Int8Codes(_interleave(codes, 4).contiguous(), w.scales, w.offsets, BYTES, 1)


def cat_rows(chunks: list[Int8Codes]) -> Int8Codes:
    if len(chunks) == 1:
        return chunks[0]
    first = chunks[0]
    return Int8Codes(torch.cat([c.codes for c in chunks]), torch.cat([c.scales for c in chunks]),
                     torch.cat([c.offsets for c in chunks]), first.layout, first.planes)


def reference(x: torch.Tensor, w: Int8Codes) -> torch.Tensor:
    """What `matmul` computes, in float64 with torch operations: for the tests."""
    M, K = x.shape
    nb = K // GROUP
    xf = x.float().reshape(M, nb, GROUP)
    amax = xf.abs().amax(-1, keepdim=True)  # float32 throughout, as the kernel rounds
    # (a tensor divided by a tensor: torch computes 127 / t as t's reciprocal times 127)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).double()
    dx = (amax / 127).double()
    N = w.codes.shape[0]
    codes = logical_codes(w).double()
    scales, offsets = logical_scales(w)
    out = torch.zeros(M, N, dtype=torch.float64)
    for p in range(w.planes):
        s = scales.reshape(N, w.planes, nb)[:, p].double()
        b = offsets.reshape(N, w.planes, nb)[:, p].double()
        isum = torch.einsum("mbi,nbi->mnb", xq, codes[:, p])
        out += (isum * s[None] * dx[..., 0][:, None]).sum(-1) + (xq.sum(-1) * dx[..., 0]) @ b.t()
    return out
