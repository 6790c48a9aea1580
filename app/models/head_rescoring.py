"""The exact logits behind a screened output projection (`quantized._rescored`), compiled
with the 8-bit activation kernel (`app.models.int8_products`: the same LLVM module, threads
and cache): each candidate's dot product with its row of x, read straight from the head's
raw Q8_0 blocks.

Why: a screened head recomputes about `exact_top` logits a row of logits exactly (SmolLM2:
384 of 49,152; Gemma 3: 1,024 of 262,144). With torch operations that is a gather of the
candidates' raw rows, their dequantization (a few operations of its own), a product with x
and a sum, ~0.2-0.4 ms a row of logits on a 2-core CPU, and it grows with every stream of a
batch; here it is one call a row that reads each candidate's blocks in place.

The arithmetic, per candidate row n and block b of 32 (Q8_0: a float16 scale d, 32 signed
bytes q):
    w_i   = float(q_i) * float(d)        exact in float32 (11 bits times 8)
    acc_c = fma(w_c, x_c, acc_c)         four accumulators of 8 lanes, one a quarter block
    y_n   = the four summed as a fixed tree, then their 8 lanes likewise
Every candidate's value is computed alone in one fixed order, so it depends neither on which
other candidates or rows share the call nor on the threads: batching changes no bit (as the
torch path: `_rescored`'s docstring). A call takes every row of a batch's logits, each
candidate with its row of x (`which`). The candidates are split among torch's OpenMP
threads in runs; each asks for the rows a few candidates ahead (their addresses are random
to the hardware's prefetchers). The candidates themselves, every logit at or above its
row's threshold, are one compiled pass over the rows too (`select_at_least`).
"""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType

from app.models import int8_products

GROUP = 32
Q8_0_BLOCK_BYTES = 34  # float16 scale, then 32 signed bytes
# Candidates ahead whose rows a thread asks for while it multiplies the current one.
_PREFETCH_ROWS = 4
# Below this many multiply-adds (candidates x inputs) one thread does the work: a parallel
# region costs a few microseconds.
_PARALLEL_WORK = 1 << 17

_DECLARE = """
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare i8 @llvm.cttz.i8(i8, i1)
"""
# rescore_work's arguments: x, rows, row_bytes, ids, which, count, nb, out
_ARGS = "%rescore_args = type { ptr, ptr, i64, ptr, ptr, i64, i64, ptr }"
_FIELDS = (("ptr", "x"), ("ptr", "rows"), ("i64", "row_bytes"), ("ptr", "ids"), ("ptr", "which"),
           ("i64", "count"), ("i64", "nb"), ("ptr", "out"))


def _dot_ir() -> str:
    """rescore_dot(x, row, nb) -> float: one Q8_0 row of nb blocks times x [nb * 32]."""
    L = ["define internal float @rescore_dot(ptr %x, ptr %row, i64 %nb) {",
         "entry:", "  br label %blk",
         "blk:", "  %b = phi i64 [0, %entry], [%bn, %blk]"]
    L += [f"  %a{c} = phi <8 x float> [zeroinitializer, %entry], [%an{c}, %blk]" for c in range(4)]
    L += ["  %bo = mul i64 %b, 34",
          "  %bp = getelementptr i8, ptr %row, i64 %bo",
          "  %dh = load half, ptr %bp, align 1",
          "  %d = fpext half %dh to float",
          "  %dv0 = insertelement <8 x float> poison, float %d, i32 0",
          "  %dv = shufflevector <8 x float> %dv0, <8 x float> poison, <8 x i32> zeroinitializer",
          "  %xo = mul i64 %b, 32"]
    for c in range(4):
        L += [f"  %qp{c} = getelementptr i8, ptr %bp, i64 {2 + 8 * c}",
              f"  %q{c} = load <8 x i8>, ptr %qp{c}, align 1",
              f"  %qf{c} = sitofp <8 x i8> %q{c} to <8 x float>",
              f"  %w{c} = fmul <8 x float> %qf{c}, %dv",
              f"  %xi{c} = add i64 %xo, {8 * c}",
              f"  %xp{c} = getelementptr float, ptr %x, i64 %xi{c}",
              f"  %xv{c} = load <8 x float>, ptr %xp{c}, align 4",
              f"  %an{c} = call <8 x float> @llvm.fma.v8f32(<8 x float> %w{c}, <8 x float> %xv{c}, <8 x float> %a{c})"]
    L += ["  %bn = add i64 %b, 1", "  %more = icmp ult i64 %bn, %nb",
          "  br i1 %more, label %blk, label %done",
          "done:",
          "  %s01 = fadd <8 x float> %an0, %an1", "  %s23 = fadd <8 x float> %an2, %an3",
          "  %s = fadd <8 x float> %s01, %s23"]
    L += int8_products.sum8_ir("%s", "%y", "rs")
    L += ["  ret float %y", "}"]
    return "\n".join(L)


def _work_ir() -> str:
    """rescore_work(args, tid, nth): this thread's run of the candidates."""
    L = ["define internal void @rescore_work(ptr %argp, i64 %tid, i64 %nth) {", "entry:"]
    for i, (ty, name) in enumerate(_FIELDS):
        L += [f"  %{name}p = getelementptr %rescore_args, ptr %argp, i32 0, i32 {i}",
              f"  %{name} = load {ty}, ptr %{name}p"]
    L += ["  %K = mul i64 %nb, 32", "  %c1 = add i64 %count, %nth", "  %c2 = sub i64 %c1, 1",
          "  %chunk = udiv i64 %c2, %nth",
          "  %i0a = mul i64 %tid, %chunk", "  %i0lt = icmp ult i64 %i0a, %count",
          "  %i0 = select i1 %i0lt, i64 %i0a, i64 %count",
          "  %i1a = add i64 %i0, %chunk", "  %i1lt = icmp ult i64 %i1a, %count",
          "  %i1 = select i1 %i1lt, i64 %i1a, i64 %count",
          "  %any = icmp ult i64 %i0, %i1",
          "  br i1 %any, label %cand, label %fin",
          "cand:",
          "  %i = phi i64 [%i0, %entry], [%in, %next]",
          # ask for the row _PREFETCH_ROWS candidates ahead, line by line (within this run)
          f"  %ia = add i64 %i, {_PREFETCH_ROWS}",
          "  %ahead = icmp ult i64 %ia, %i1",
          "  br i1 %ahead, label %pf_start, label %dot",
          "pf_start:",
          "  %pidp = getelementptr i64, ptr %ids, i64 %ia",
          "  %pid = load i64, ptr %pidp, align 8",
          "  %po = mul i64 %pid, %row_bytes",
          "  %prow = getelementptr i8, ptr %rows, i64 %po",
          "  br label %pf",
          "pf:",
          "  %pl = phi i64 [0, %pf_start], [%pln, %pf]",
          "  %plp = getelementptr i8, ptr %prow, i64 %pl",
          "  call void @llvm.prefetch.p0(ptr %plp, i32 0, i32 3, i32 1)",
          "  %pln = add i64 %pl, 64",
          "  %pmore = icmp ult i64 %pln, %row_bytes",
          "  br i1 %pmore, label %pf, label %dot",
          "dot:",
          "  %idp = getelementptr i64, ptr %ids, i64 %i",
          "  %id = load i64, ptr %idp, align 8",
          "  %ro = mul i64 %id, %row_bytes",
          "  %row = getelementptr i8, ptr %rows, i64 %ro",
          "  %whp = getelementptr i64, ptr %which, i64 %i",  # the candidate's row of x
          "  %wh = load i64, ptr %whp, align 8",
          "  %xw = mul i64 %wh, %K",
          "  %xr = getelementptr float, ptr %x, i64 %xw",
          "  %y = call float @rescore_dot(ptr %xr, ptr %row, i64 %nb)",
          "  %yp = getelementptr float, ptr %out, i64 %i",
          "  store float %y, ptr %yp, align 4",
          "  br label %next",
          "next:",
          "  %in = add i64 %i, 1",
          "  %more = icmp ult i64 %in, %i1",
          "  br i1 %more, label %cand, label %fin",
          "fin:", "  ret void", "}"]
    return "\n".join(L)


def _entry_ir(name: str, struct: str, fields: tuple, work: str, threaded: bool) -> str:
    """define void @`name`(the fields in order, i32 threads): its arguments into a
    %`struct`, then @`work` on torch's OpenMP pool (`int8_products.parallel_ir`)."""
    extra, run = int8_products.parallel_ir(threaded, work, f"{name}_omp_body")
    params = ", ".join(f"{ty} %{field}" for ty, field in fields)
    L = [f"define void @{name}({params}, i32 %threads) {{", "entry:", f"  %a = alloca %{struct}"]
    for i, (ty, field) in enumerate(fields):
        L += [f"  %f{i} = getelementptr %{struct}, ptr %a, i32 0, i32 {i}",
              f"  store {ty} %{field}, ptr %f{i}"]
    L += [*run, "  ret void", "}"]
    return extra + "\n".join(L)


def _driver_ir(threaded: bool) -> str:
    """rescore(x, rows, row_bytes, ids, which, count, nb, out, threads)."""
    return _entry_ir("rescore", "rescore_args", _FIELDS, "rescore_work", threaded)


# select_work's arguments: values, least, n, V, cap, ids, counts
_SELECT_ARGS = "%select_args = type { ptr, ptr, i64, i64, i64, ptr, ptr }"
_SELECT_FIELDS = (("ptr", "values"), ("ptr", "least"), ("i64", "n"), ("i64", "V"), ("i64", "cap"),
                  ("ptr", "ids"), ("ptr", "counts"))


def _select_ir(threaded: bool) -> str:
    """select_at_least(values, least, n, V, cap, ids, counts, threads): for each row r of
    values [n, V] (V a multiple of 8), the ids i with values[r, i] >= least[r] (an ordered
    comparison: never NaN), ascending, the first `cap` of them into ids [n, cap] and their
    number, past `cap` too, into counts [n]; the rows split among the threads."""
    L = ["define internal void @select_work(ptr %argp, i64 %tid, i64 %nth) {", "entry:"]
    for i, (ty, name) in enumerate(_SELECT_FIELDS):
        L += [f"  %{name}p = getelementptr %select_args, ptr %argp, i32 0, i32 {i}",
              f"  %{name} = load {ty}, ptr %{name}p"]
    L += ["  %any = icmp ult i64 %tid, %n",
          "  br i1 %any, label %row, label %fin",
          "row:",
          "  %r = phi i64 [%tid, %entry], [%rn, %row_end]",
          "  %ro = mul i64 %r, %V",
          "  %vr = getelementptr float, ptr %values, i64 %ro",
          "  %oo = mul i64 %r, %cap",
          "  %out = getelementptr i64, ptr %ids, i64 %oo",
          "  %lp = getelementptr float, ptr %least, i64 %r",
          "  %l = load float, ptr %lp, align 4",
          "  %lv0 = insertelement <8 x float> poison, float %l, i32 0",
          "  %lv = shufflevector <8 x float> %lv0, <8 x float> poison, <8 x i32> zeroinitializer",
          "  br label %scan",
          "scan:",
          "  %i = phi i64 [0, %row], [%in, %next]",
          "  %c = phi i64 [0, %row], [%cn, %next]",
          "  %vp = getelementptr float, ptr %vr, i64 %i",
          "  %v = load <8 x float>, ptr %vp, align 4",
          "  %m = fcmp oge <8 x float> %v, %lv",
          "  %bits = bitcast <8 x i1> %m to i8",
          "  %hit = icmp ne i8 %bits, 0",
          "  br i1 %hit, label %emit, label %next",
          "emit:",  # each set bit, lowest first: its id, while there is room
          "  %b = phi i8 [%bits, %scan], [%brest, %stored]",
          "  %ce = phi i64 [%c, %scan], [%ce1, %stored]",
          "  %tz = call i8 @llvm.cttz.i8(i8 %b, i1 true)",
          "  %tz64 = zext i8 %tz to i64",
          "  %id = add i64 %i, %tz64",
          "  %room = icmp ult i64 %ce, %cap",
          "  br i1 %room, label %store, label %stored",
          "store:",
          "  %op = getelementptr i64, ptr %out, i64 %ce",
          "  store i64 %id, ptr %op, align 8",
          "  br label %stored",
          "stored:",
          "  %ce1 = add i64 %ce, 1",
          "  %bm1 = sub i8 %b, 1",
          "  %brest = and i8 %b, %bm1",
          "  %bmore = icmp ne i8 %brest, 0",
          "  br i1 %bmore, label %emit, label %next",
          "next:",
          "  %cn = phi i64 [%c, %scan], [%ce1, %stored]",
          "  %in = add i64 %i, 8",
          "  %more = icmp ult i64 %in, %V",
          "  br i1 %more, label %scan, label %row_end",
          "row_end:",
          "  %cp = getelementptr i64, ptr %counts, i64 %r",
          "  store i64 %cn, ptr %cp, align 8",
          "  %rn = add i64 %r, %nth",
          "  %rmore = icmp ult i64 %rn, %n",
          "  br i1 %rmore, label %row, label %fin",
          "fin:", "  ret void", "}"]
    return "\n".join(L) + "\n" + _entry_ir("select_at_least", "select_args", _SELECT_FIELDS,
                                           "select_work", threaded)


def rescoring_ir(threaded: bool, declared: str) -> str:
    """This kernel's part of the module; `declared` is the rest of it (declarations it
    shares are not repeated)."""
    header = "\n".join(line for line in _DECLARE.strip().splitlines()
                       if line.split("(")[0] + "(" not in declared)
    return "\n".join([header, _ARGS, _SELECT_ARGS, _dot_ir(), _work_ir(), _driver_ir(threaded),
                      _select_ir(threaded)])


# ---- calling it -------------------------------------------------------------------------------


def serves(ggml_type, x: torch.Tensor) -> bool:
    """Whether rows stored as `ggml_type` are rescored here for x (on the CPU, float32
    width whole blocks) where the kernel compiled."""
    return (ggml_type == GGMLQuantizationType.Q8_0 and x.device.type == "cpu"
            and x.shape[-1] % GROUP == 0 and int8_products.kernel() is not None)


def rescore(x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
            which: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [K] or [R, K] (any float dtype is converted), rows uint8 [V, K / 32 * 34]
    (Q8_0 blocks), ids int64 [n] in 0..V-1 -> float32 [n]: each id's row times x, or with
    `which` (int64 [n] in 0..R-1) times x's row `which[i]`: every row of a batch's logits
    in one call (one parallel region, not one a row)."""
    k = int8_products.kernel()
    if k is None:
        raise RuntimeError(f"The compiled kernels are not available: {int8_products.unavailable_reason()}")
    K = x.shape[-1]
    if x.dim() not in (1, 2) or K % GROUP:
        raise ValueError("head_rescoring.rescore: x must be rows of whole blocks of 32")
    nb = K // GROUP
    if not (rows.dtype == torch.uint8 and rows.dim() == 2 and rows.shape[1] == nb * Q8_0_BLOCK_BYTES):
        raise ValueError(f"head_rescoring.rescore: rows {tuple(rows.shape)} are not Q8_0 rows of {K}")
    if rows.stride(1) != 1 or rows.stride(0) < rows.shape[1]:
        rows = rows.contiguous()
    ids = _index(ids)
    x_rows = 1 if x.dim() == 1 else x.shape[0]
    if which is None:
        if x.dim() != 1:
            raise ValueError("head_rescoring.rescore: rows of x need `which`, a row a candidate")
        which = torch.zeros(ids.numel(), dtype=torch.int64)
    which = _index(which)
    if which.numel() != ids.numel():
        raise ValueError("head_rescoring.rescore: `which` needs one row of x a candidate")
    if ids.numel():  # the kernel trusts both
        _within(ids, rows.shape[0], "an id outside the rows")
        _within(which, x_rows, "a candidate's row outside x")
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    out = torch.empty(ids.numel(), dtype=torch.float32)
    if ids.numel():
        threads = torch.get_num_threads() if ids.numel() * K >= _PARALLEL_WORK else 1
        k.rescore(xf.data_ptr(), rows.data_ptr(), rows.stride(0), ids.data_ptr(), which.data_ptr(),
                  ids.numel(), nb, out.data_ptr(), threads)
    return out


def _index(t: torch.Tensor) -> torch.Tensor:
    """t as the kernel reads an index array: int64, contiguous, one dimension."""
    if t.dtype != torch.int64 or not t.is_contiguous() or t.dim() != 1:
        t = t.to(torch.int64).contiguous().view(-1)
    return t


def _within(t: torch.Tensor, size: int, what: str) -> None:
    lowest, highest = t.aminmax()
    if not (0 <= int(lowest) and int(highest) < size):
        raise ValueError(f"head_rescoring.rescore: {what}")


def selects(values: torch.Tensor) -> bool:
    """Whether `select_at_least` takes these logits: float32 rows of whole vectors of 8 on
    the CPU, where the kernel compiled."""
    return (values.dtype == torch.float32 and values.dim() == 2 and values.device.type == "cpu"
            and values.shape[1] % 8 == 0 and values.shape[1] > 0
            and int8_products.kernel() is not None)


def select_at_least(values: torch.Tensor, least: torch.Tensor, cap: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """values float32 [n, V], least float32 [n] -> (ids int64 [n, cap], counts int64 [n]):
    row r's ids i with values[r, i] >= least[r], ascending, as numpy's
    `flatnonzero(row >= least)` gives them (NaN never), the first `cap` in ids[r] and how many
    there are, past `cap` too, in counts[r]. One pass over the logits in one call, the rows on
    torch's threads (numpy's comparison and `flatnonzero` took ~67 us a row of 262,144 on a
    2-core AMD EPYC)."""
    k = int8_products.kernel()
    if k is None:
        raise RuntimeError(f"The compiled kernels are not available: {int8_products.unavailable_reason()}")
    if not selects(values):
        raise ValueError("head_rescoring.select_at_least: float32 rows [n, V], V a multiple of 8")
    n, vocab = values.shape
    least = least.to(torch.float32).contiguous().view(-1)
    if least.numel() != n or cap < 1:
        raise ValueError("head_rescoring.select_at_least: one threshold a row, and room for an id")
    values = values.contiguous()
    ids = torch.empty(n, cap, dtype=torch.int64)
    counts = torch.empty(n, dtype=torch.int64)
    k.select(values.data_ptr(), least.data_ptr(), n, vocab, cap, ids.data_ptr(), counts.data_ptr(),
             min(n, torch.get_num_threads()))
    return ids, counts


def reference(x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
              which: torch.Tensor | None = None) -> torch.Tensor:
    """What `rescore` computes, in float64 from the blocks: for the tests."""
    blocks = rows.index_select(0, ids).reshape(ids.numel(), -1, Q8_0_BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).double()  # [n, nb, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).double()  # [n, nb, 32]
    xs = x.double() if which is None else x.double()[which]
    return ((q * d).reshape(ids.numel(), -1) * xs).sum(-1)
