"""The CPU weight policy, measured on the machine rather than assumed.

CPUs differ more than any fixed rule can follow: on one with AVX-512-BF16/AMX a bfloat16
matrix product is the fastest prefill kernel torch has, on an AVX2-only one it is the
slowest (measured 14.7 s against float16's 3.2 s for a 1,024-token prefill). So the engine
times its candidate kernels on the model's own linear products, one row (decode) and
`PREFILL_ROWS` rows (prefill), through the same `linear()` the model runs, and picks per
product the fastest candidate that meets the quality bar. Decisions depend on those timings
alone, never on the CPU's name or on the kernels torch lists.

What is timed is what the engine runs (`ModelShapes`): Q, K, V joined into one product and
gate, up into another, as `finish_loading` joins them; for the 4-bit kinds each weight with
its own planes (Q5/Q8/Q6_K blocks: two, Q4: one) and the weights that stay float charged at
the fastest float kind's time, as a 4-bit load stores them. A decode step reads every weight
from memory once; so a decode pass cycles through distinct copies of the weights, at least
twice the last-level cache in all (never more than the model has), instead of timing one
cache-resident weight and multiplying (that favoured wide floats: Gemma 3 270M measured
float16 24.5 ms against int4 36.1 ms a step, where the engine decodes faster with int4).

Robust against a busy machine (another process's burst must not stick for months):
  - candidates are timed interleaved (every repetition times every kind once, in rotated
    order), and each kind's figure is its median over the repetitions; a kind more than
    `SLOW_CUT` times slower than the fastest in the first repetition is not timed again (it
    cannot win; the 4-bit kernel with float32 activations takes seconds a step on some CPUs);
  - a kind other than the safe default (`DEFAULT`: float16, whose matrix-vector kernel is
    fast everywhere and whose many-row products upcast to float32) is chosen only when it
    beats the default by more than the measured noise (and at least `MIN_GAIN`);
  - a measurement whose timings are erratic (relative spread above `ERRATIC`) or whose
    threads stalled (below) is taken once more (`MEASURE_TRIES`): on a shared 2-core host
    one measurement in a few was erratic on a single burst, and the default then cost
    Gemma 3 270M ~2.4x its decode speed until the next load. When every try is unusable,
    or the tries run past `BUDGET_S`, the default is kept and nothing is cached; an
    interrupted measurement (the engine got work) is thrown away;
  - the stall rule: before every kind's timing an empty parallel region is timed (`_probe_ms`:
    a few microseconds when torch's threads have their cores). When another program holds a
    core the pool's threads need, waking them takes milliseconds, and every multi-threaded
    kernel is charged that wait while the single-threaded ones (float32's small matrix-vector
    product) are not: a cached entry measured so had float32 38 ms a step against 2,500 ms
    for every other kind, with a spread of only 22%. When more than `STALLED_MAX` of the
    probes took over `STALL_MS`, the figures are the scheduler's, not the kernels';
  - a cached choice is checked on later loads (`check`): every allowed decode kind is
    re-timed (decode products are cheap), and for prefill the choice, its runner-up and the
    default, for `VALIDATE_REPS` repetitions. The entry is measured again when a kind now
    beats the choice beyond noise, when the choice's own time drifted more than `DRIFT`
    times either way from its cached figure, or when it is older than `MAX_AGE_DAYS`; when
    that re-measurement is unusable (erratic, stalled, past its budget) the cached choice is
    kept, saying so, rather than dropping to the default.
The session measures in the background once a usable model is loaded (`tune`), so loading
never waits for it; until a model is measured it loads in the choice measured for another
model on the same CPU, torch and threads (`borrowed_policy`), or in the default when there is
none (`default_policy`: float16, decoding with a 4-bit kind where the model has 4-bit
products and a kernel for them runs: `provisional_decode`); the command line
(`load_on(measure=True)`, `policy_for`) measures, or checks the cached entry, before loading.
Results are cached per measurement (`MEASURE_VERSION`, `PREFILL_ROWS`, the candidate kinds),
CPU (model name and torch's capability), torch version, thread count and model products in
`kernel_policy.json` in the data folder; entries of another measurement are ignored and
pruned. A damaged cache file is ignored and rewritten.

Candidates (`KINDS`): float32, bfloat16, float16, the 4-bit weight-only kernel with
bfloat16 or float32 activations (`app.models.quantized`), and 4-bit weights multiplied by
activations quantized to 8 bits (`int4_i8`, `app.models.int8_products`, where it compiles).
Every one meets the quality bar
of a mean negative log-likelihood within 0.5% of the float32 model on a long public text
(scripts/measure_weight_quality.py reports the figures per format and model); a kind that
ever fails it belongs in `FAILS_QUALITY` and is never chosen.

The KV cache's dtype is measured in the same repetitions (`KV_KINDS`): one decode step's
attention, every layer over its own keys at `KV_CONTEXT` positions (so the keys come from
memory, as in a long chat), and one prefill chunk's attention, in float32 and in bfloat16.
A long chat's decode step is mostly attention; bfloat16 keys are half the bytes, which pays
where attention waits for memory and the CPU converts bfloat16 quickly (measured on a 2-core
AMX Xeon: 30 layers at 3,000 positions 12.6 -> 9.4 ms, equal at 1,000), and costs where it
does not. bfloat16 is chosen only when it beats float32 by more than the noise (and
`MIN_GAIN`) in decode or prefill attention and is no slower beyond the noise in either
(Gemma 3 270M's sliding layers read 512 positions at most, so its decode gains little while
its prefill chunks' attention took 2.0 ms against 7.2); float32
stays the default, and the exact reference (a dtype chosen by hand keeps its KV in the
activations' dtype). Its quality cost is reported by the same script (`--kv bfloat16`).

The same repetitions time that decode step's attention asked per query head (`enable_gqa`)
instead of per KV head, in the chosen dtype (`pick_layout`). torch's CPU kernel multiplies
each block of keys by a KV head's G queries in one small product; on a 2-core AMX Xeon G
products of one query each were faster over long contexts for SmolLM2 (3 queries a KV head:
30 layers at 4,096 positions 13.9 -> 9.6 ms timed alone; its decode after 4,000 prompt
tokens +17% in the engine) and slower for Gemma 3
270M (4 of head size 256: 454 -> 664 us a layer) and for both over short contexts. So when
per head beats per KV head at `KV_CONTEXT` positions beyond the noise, decode steps over at
least `PER_HEAD_FROM` keys ask per head; shorter ones, and every other case, per KV head.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType

from app.heap import release_freed_memory
from app.models import int8_products
from app.models.layers import WeightFormat, linear, weights_transposed
from app.models.quantized import (Int4Codes, Int4Form, QuantizedWeight, codes_tensors,
                                  int4_kernel_available, int4_kernel_runs, int8_codes,
                                  kernel_planes, pack_int4, quantize_int4, screens)

CACHE_FILE = "kernel_policy.json"
CACHE_VERSION = 3  # the layout of an entry (3: the measurement's own parameters in the key)
# What a measurement times. Bumped whenever that changes, so older entries are measured again:
# 3: products as the engine runs them (joined QKV and gate/up, 4-bit planes per weight, float
# leftovers of a 4-bit load), weights streamed past the last-level cache, the stall probe.
# 4: the KV cache's dtype (attention in float32 and bfloat16) in the same repetitions;
# 5: bfloat16 KV taken for a prefill win too.
# 6: and for a decode win whose prefill attention costs a chunk at most KV_PREFILL_SHARE more.
# 7: decode attention per query head as well (`pick_layout`).
# 8: the 4-bit weights with activations quantized to 8 bits (`int4_i8`) as a candidate.
MEASURE_VERSION = 8
# Rows of a timed prefill product: the engine's whole chunk (EngineConfig.prefill_chunk),
# where kernels part ways most (measured on one AVX-512 core, 2048x640: bfloat16 9.8 -> 19.8
# ms from 128 to 512 rows, the 4-bit kernel 6.4 -> 62.7 ms). Each distinct shape is timed
# once per repetition, so this stays well under a second per repetition for small models.
PREFILL_ROWS = 512
KINDS = ("float32", "bfloat16", "float16", "int4_bf16", "int4_f32", "int4_i8")
# The 4-bit kernel with float32 activations is a decode candidate only: on CPUs measured so
# far its many-row product is 100x slower than any other (no vectorized path).
PREFILL_KINDS = ("float32", "bfloat16", "float16", "int4_bf16", "int4_i8")
# The 4-bit kinds' activation dtype for torch's kernel. `int4_i8` multiplies by activations
# quantized to 8 bits where `app.models.int8_products` takes the weight (its inputs whole
# pairs of blocks), and by torch's kernel with bfloat16 activations where not.
_INT4_ACTS = {"int4_bf16": torch.bfloat16, "int4_f32": torch.float32, "int4_i8": torch.bfloat16}
INT8_KIND = "int4_i8"
FAILS_QUALITY: frozenset[str] = frozenset()
# What a candidate must beat, and what runs before anything is measured: float16 weights
# (one copy; fast matrix-vector kernel on AVX2 and AVX-512 alike; many-row products upcast
# to float32, never bfloat16's slow AVX2 path).
DEFAULT = "float16"
# ... except that a model with 4-bit products decodes with a 4-bit kind until measured
# (`provisional_decode`). torch's 4-bit kernel decoded 2.3-4.3x faster than float16 with
# torch's AVX-512 and AVX2 kernels alike (the policy's own timings, 2-core AMX Xeon, 2
# threads, ms a step, 4-bit / float16 / float32: SmolLM2 6.4 / 27.4 / 19.8, Gemma 3 270M
# 17.9 / 44.7 / 35.9; on torch's AVX2 kernels 9.9 / 26.9 / 20.8 and 19.4 / 45.2 / 86.3); a
# first start on a machine never measured had decoded SmolLM2's first reply at ~31 tok/s in
# float16 against ~116 (the reply came before the background measurement, which waits for
# the engine to be idle). The 8-bit activation kernel's `int4_i8` is what the measurement
# has chosen for both built-in models on both instruction sets since (an AVX-512 Xeon, an
# AVX2-only AMD EPYC), ~1.7x torch's 4-bit kernel in the policy's own steps on the EPYC
# (SmolLM2 10.3 against 17.7 ms, Gemma 3 270M 18.9 against 34.5) and ~2.5x in the engine;
# it comes first where it is ready without compiling (`int8_products.ready`: its machine
# code saved, as the set-up leaves it), since a first compile takes ~4 s. Prefill stays
# float16's (bfloat16's prefill is the slow one on AVX2). The measurement decides.
PROVISIONAL_DECODES = (INT8_KIND, "int4_bf16")
REPS = 5  # interleaved repetitions of a full measurement
VALIDATE_REPS = 3
MIN_GAIN = 0.05  # a non-default kind must be at least this much faster than the default
ERRATIC = 0.25  # relative spread of a leading kind's timings above which nothing is cached
DRIFT = 1.6  # the choice's re-timed figure against its cached one, either way: measure again
SLOW_CUT = 3.0  # a kind this many times slower than the fastest in the first repetition stops
STALL_MS = 1.0  # an empty parallel region slower than this: the threads waited for a core
STALLED_MAX = 0.2  # more than this share of stalled probes: the measurement is not used
MAX_AGE_DAYS = 30
BUDGET_S = 30.0  # a full measurement's limit (about 2-5 s on an idle 2-core machine)
MEASURE_TRIES = 2  # measurements taken before an erratic or stalled machine keeps the default
_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Rows of the output projection timed (its cost is scaled up to the whole vocabulary): the
# full product of a 262,144-token vocabulary would take most of the time budget on its own.
_HEAD_ROWS_TIMED = 8_192
# A decode pass stops cycling through weight copies after this long (a slow kind's products
# are bound by arithmetic, not by memory: more copies would only cost time).
_PASS_CAP_S = 0.1
# At most this many bytes of weight copies per kind, whatever the cache size says.
_STREAM_MAX_BYTES = 256 * 2**20
# KV cache candidates, the default first (what a cache holds when no measurement says otherwise).
KV_KINDS = ("float32", "bfloat16")
KV_DEFAULT = "float32"
# A bfloat16 KV cache faster at decode may be this much of a prefill chunk's time slower there.
KV_PREFILL_SHARE = 0.05
# Positions a timed decode attention reads per layer: a chat with a document in it.
KV_CONTEXT = 2048
# Queries of the timed prefill attention (one layer; keys: the chunk and as many before it).
KV_PREFILL_ROWS = PREFILL_ROWS
# Where per-head decode attention is measured faster at KV_CONTEXT, it is used from this many
# keys on: SmolLM2 on a 2-core AMX Xeon crossed over near 512 (timed alone) and decoded 9.6%
# faster at 1,500 positions in the engine; short contexts stay per KV head, as measured there.
PER_HEAD_FROM = KV_CONTEXT // 2
# Two copies of the weights (decode and prefill kinds differ) only for model files up to
# this size (a Q4 file of 800 MB is ~1.4B parameters: 5.6 GB as float16 + bfloat16, or ~3.5 GB
# as 4-bit planes + a bfloat16 copy). `device.resolve_weights` holds unmeasured loads to it too.
TWO_COPIES_MAX_FILE_BYTES = 800 * 2**20
HEAD = "head"  # the output projection's key among a pass's timings


@dataclass(frozen=True)
class ModelShapes:
    """The linear products of one decoding step, as the engine runs them.

    `layers`: (out, in) -> products per step when every weight is a float (Q, K, V joined,
    gate and up joined). `int4_layers`: (out, in, planes) -> products per step when weights
    whose blocks fit the 4-bit kernel stay quantized: planes 1 (Q4 blocks) or 2 (Q5/Q8,
    and Q2_K/Q3_K/Q6_K approximated), 0 for a weight that stays a float (float tensors;
    `quantized.kernel_planes`); joined only where `layers.fuse`
    joins them (same planes, parts of 64-row multiples). `head`: the output projection
    (out, in), with `head_planes` as a 4-bit weight (0: it stays a float). `kv`: (layers,
    query heads, KV heads, head dim) of its attention, for timing the KV cache's dtype
    (zeros: unknown, the cache keeps its default)."""

    name: str
    layers: dict[tuple[int, int], int]
    head: tuple[int, int]
    int4_layers: dict[tuple[int, int, int], int] = field(default_factory=dict)
    head_planes: int = 0
    kv: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def int4_fraction(self) -> float:
        """Of the weight elements a decode step multiplies by, the share that stays 4-bit."""
        n, k = self.head
        fit, total = (n * k if self.head_planes else 0), n * k
        for (rows, cols, planes), count in self.int4_layers.items():
            total += rows * cols * count
            fit += rows * cols * count if planes else 0
        return fit / total

    def key(self) -> str:
        floats = ",".join(f"{n}x{k}*{c}" for (n, k), c in sorted(self.layers.items()))
        int4 = ",".join(f"{n}x{k}/{p}*{c}" for (n, k, p), c in sorted(self.int4_layers.items()))
        kv = "/".join(map(str, self.kv))
        return (f"{self.name}|{floats}|int4 {int4}|head {self.head[0]}x{self.head[1]}/"
                f"{self.head_planes}|kv {kv}")


# How a policy was arrived at, for the status bar, `bench` and the comparison script.
MEASURED = "measured now"
CHECKED = "cached, checked now"
CHECK_UNCLEAR = "cached, check inconclusive"
KEPT = "cached, kept (its re-measurement was unusable)"
UNCHECKED = "cached, not checked"
NOT_MEASURED = "default, not measured"
DEFAULT_SAYS = "(default)"  # follows the default's label in its reason
BORROWED = "another model's measurement on this CPU, this model not measured yet"


@dataclass
class Policy:
    """What to store and multiply with: the decode kind, the prefill kind, the KV cache's
    dtype, and why."""

    decode: str
    prefill: str
    label: str
    reason: str
    decode_ms: dict[str, float]
    prefill_ms: dict[str, float]
    cached: bool = False
    noise: float = 0.0  # the largest relative spread of the leading kinds' timings
    measured_at: float = 0.0  # time.time() of the full measurement
    status: str = ""  # MEASURED, CHECKED, ...: not stored
    kv: str = KV_DEFAULT
    kv_ms: dict[str, float] = field(default_factory=dict)  # a decode step's attention
    kv_per_head: bool = False  # long decode steps ask attention per query head (`pick_layout`)
    # The KV timings were erratic, so the cache kept its default: the next check measures
    # again rather than re-timing a choice that was never made (`check`).
    kv_unsettled: bool = False

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The KV cache's dtype, or None for the default (the activations' dtype)."""
        return None if self.kv == KV_DEFAULT else _FLOAT[self.kv]

    @property
    def per_head_from(self) -> int | None:
        """From how many keys a decode step asks attention per query head (None: never)."""
        return PER_HEAD_FROM if self.kv_per_head else None

    def weight_format(self, device: torch.device, file_bytes: int) -> tuple[WeightFormat, torch.dtype | None]:
        """The format to load with, and the wide (prefill) float dtype when two copies are kept.

        Weights that cannot stay 4-bit (other block types) follow the fastest float kinds."""
        decode, prefill = self.decode, self.prefill
        two = file_bytes <= TWO_COPIES_MAX_FILE_BYTES
        if decode.startswith("int4"):
            act = _INT4_ACTS[decode]
            float_decode = _best(self.decode_ms, _FLOAT)
            float_prefill = _best(self.prefill_ms, _FLOAT)
            int4_wide = None if prefill.startswith("int4") or not two else _FLOAT[prefill]
            narrow = _FLOAT[float_decode]
            wide = _FLOAT[float_prefill] if two and float_prefill != float_decode else None
            return (WeightFormat(narrow, weights_transposed(device, narrow), wide, True, act, int4_wide,
                                 int8_acts=decode == INT8_KIND),
                    wide)
        narrow = _FLOAT[decode]
        if prefill.startswith("int4") or prefill == decode or not two:
            return WeightFormat(narrow, weights_transposed(device, narrow)), None
        wide = _FLOAT[prefill]
        return WeightFormat(narrow, weights_transposed(device, narrow), wide), wide


def provisional_decode(shapes: ModelShapes | None, failed=()) -> str:
    """What a model decodes with until this machine is measured: the first of
    `PROVISIONAL_DECODES` this model and machine run without compiling anything now (torch's
    4-bit kernel multiplying right, which `int4_i8` also takes its other products to) and no
    measurement saw `failed`; float16 for a model without 4-bit products or where none runs."""
    if shapes is None or not int4_kernel_runs():
        return DEFAULT
    allowed = _allowed(shapes, PROVISIONAL_DECODES, compile=False)
    return next((kind for kind in allowed if kind not in failed), DEFAULT)


def default_policy(why: str, shapes: ModelShapes | None = None, failed=()) -> Policy:
    """The format used until this machine is measured: float16, decoding with a 4-bit kind
    (`provisional_decode`) when `shapes` has 4-bit products and one runs here."""
    decode = provisional_decode(shapes, failed)
    label = decode if decode == DEFAULT else f"{decode} decode, {DEFAULT} prefill"
    return Policy(decode, DEFAULT, label, f"{label} {DEFAULT_SAYS} {why}", {}, {},
                  status=NOT_MEASURED)


def _best(times: dict[str, float], among) -> str:
    """The fastest of `among` in `times`; the default when none was timed."""
    timed = [k for k in times if k in among]
    return min(timed, key=times.__getitem__) if timed else DEFAULT


# ---- the machine's identity ----------------------------------------------------------------


def cpu_identity() -> str:
    """e.g. "Intel(R) Xeon(R) Processor | AVX512 | 2 threads"."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return f"{model} | {torch.backends.cpu.get_cpu_capability()} | {torch.get_num_threads()} threads"


def measurement_id() -> str:
    """Everything about the measurement itself that changes its figures: its version, the
    prefill rows and the candidate kinds. Part of every cache key, so changing any of them
    measures again."""
    return (f"v{CACHE_VERSION} m{MEASURE_VERSION} | {PREFILL_ROWS} rows | "
            f"{'/'.join(KINDS)} | prefill {'/'.join(PREFILL_KINDS)} | "
            f"kv {'/'.join(KV_KINDS)} at {KV_CONTEXT}")


def cache_key(shapes: ModelShapes) -> str:
    return f"{measurement_id()} | {cpu_identity()} | torch {torch.__version__} | {shapes.key()}"


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), or 32 MiB when it cannot be read."""
    best = 0
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return best or 32 * 2**20


# ---- the cache -----------------------------------------------------------------------------


def read_cache(path: Path) -> dict:
    """The cache's policy entries, or {} when it is missing or damaged (then it gets rewritten)."""
    return _read_section(path, "entries")


def _read_section(path: Path, section: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict) or not isinstance(data.get(section), dict):
        return {}
    return data[section]


def _policy_from(entry) -> Policy | None:
    try:
        policy = Policy(**{**entry, "cached": True, "status": UNCHECKED})
    except TypeError:
        return None
    numbers = [*policy.decode_ms.values(), *policy.prefill_ms.values(), *policy.kv_ms.values(),
               policy.noise, policy.measured_at] if all(
                   isinstance(t, dict) for t in (policy.decode_ms, policy.prefill_ms, policy.kv_ms)
               ) else [None]
    ok = (policy.decode in KINDS and policy.prefill in KINDS and policy.decode in policy.decode_ms
          and policy.prefill in policy.prefill_ms and policy.kv in KV_KINDS
          and isinstance(policy.kv_per_head, bool) and isinstance(policy.kv_unsettled, bool)
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers))
    return policy if ok else None


def write_cache(path: Path, entries: dict | None = None, files: dict | None = None) -> None:
    """Atomically (a reader never sees half a file); a section not given is kept as it is."""
    data = {"entries": read_cache(path) if entries is None else entries,
            "files": _read_section(path, "files") if files is None else files}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


# ---- what a kind runs ----------------------------------------------------------------------

Key = tuple[int, int, int] | str  # (out, in, planes) of a product, or HEAD


@dataclass(frozen=True)
class _Counts:
    """Per-step counts of one kind: `own` products timed in this kind (with HEAD scaled to the
    whole vocabulary), `borrowed` float products of a 4-bit load, charged at the fastest float
    kind's times, `extra` float products timed only so the 4-bit kinds can borrow them."""

    own: dict
    borrowed: dict
    extra: dict


def _counts(shapes: ModelShapes, kind: str) -> _Counts:
    head_n, head_k = shapes.head
    head_scale = head_n / min(head_n, _HEAD_ROWS_TIMED)
    if kind in _FLOAT:
        own = {(n, k, 0): c for (n, k), c in shapes.layers.items()}
        extra = {(n, k, 0): c for (n, k, p), c in shapes.int4_layers.items()
                 if p == 0 and (n, k, 0) not in own}
        return _Counts({**own, HEAD: head_scale}, {}, extra)
    own = {key: c for key, c in shapes.int4_layers.items() if key[2]}
    borrowed = {key: c for key, c in shapes.int4_layers.items() if not key[2]}
    if shapes.head_planes:
        own[HEAD] = head_scale
    else:
        borrowed[HEAD] = head_scale
    return _Counts(own, borrowed, {})


def _weight(kind: str, n: int, k: int, planes: int, gen: torch.Generator):
    """A random [n, k] weight as `kind` stores it (`planes` 4-bit planes for the 4-bit kinds),
    and whether it is stored transposed."""
    w = torch.randn(n, k, generator=gen) * 0.05
    if kind.startswith("int4"):
        act = _INT4_ACTS[kind]
        form = quantize_int4(w)
        if planes == 2:  # Q5/Q8/Q6_K blocks: a second plane (as Q8_0's: -8..7, two planes for
            # the 8-bit activation kernel too, where Q5's would take one)
            form = Int4Form(form.lo, torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8),
                            form.s, form.b)
        if kind == INT8_KIND and int8_products.fits(k):
            return QuantizedWeight(int8_codes(form, GGMLQuantizationType.Q8_0), n, k,
                                   torch.float32), False
        return QuantizedWeight(pack_int4(form, act), n, k, act), False
    dtype = _FLOAT[kind]
    transposed = weights_transposed(torch.device("cpu"), dtype)
    return WeightFormat(dtype, transposed).prepare(w), transposed


def _nbytes(w) -> int:
    if isinstance(w, QuantizedWeight):
        return sum(t.nbytes for t in codes_tensors(w.codes))
    return w.nbytes


def _copy(w):
    if isinstance(w, QuantizedWeight):
        c = w.codes
        if isinstance(c, Int4Codes):
            return dataclasses.replace(w, codes=Int4Codes(c.packed.clone(), c.scale_zeros.clone(),
                                                          c.planes))
        return dataclasses.replace(w, codes=dataclasses.replace(
            c, codes=c.codes.clone(), scales=c.scales.clone(), offsets=c.offsets.clone()))
    return w.clone()


@dataclass
class _Product:
    weights: list  # distinct copies, used in turn
    transposed: bool
    x1: torch.Tensor
    xp: torch.Tensor


class _Interrupted(Exception):
    """`busy()` turned true while a measurement was being set up."""


class _KindRun:
    """One kind's weights, ready to time. A decode pass runs every distinct product once per
    cycle, each cycle on other copies of the weights, so that together they exceed the
    last-level cache (at most as many copies as the model has layers): the weights come from
    memory, as they do in a decode step. The head comes after, past everything else."""

    def __init__(self, shapes: ModelShapes, kind: str, gen: torch.Generator, stream_bytes: int,
                 inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 busy: Callable[[], bool] | None = None):
        def check() -> None:
            if busy is not None and busy():
                raise _Interrupted

        counts = _counts(shapes, kind)
        self.products: dict[Key, _Product] = {}
        layer_counts = {**counts.own, **counts.extra}
        layer_counts.pop(HEAD, None)
        for key in layer_counts:
            check()
            n, k, planes = key
            w, t = _weight(kind, n, k, planes, gen)
            self.products[key] = _Product([w], t, *inputs(k))
        self.head = None  # a 4-bit load whose head stays a float borrows a float kind's time
        if HEAD in counts.own:
            head_n, head_k = shapes.head
            w, t = _weight(kind, min(head_n, _HEAD_ROWS_TIMED), head_k, shapes.head_planes, gen)
            self.head = _Product([w], t, *inputs(head_k))
        set_bytes = sum(_nbytes(p.weights[0]) for p in self.products.values()) or 1
        most = max([math.ceil(c) for c in layer_counts.values()] or [1])
        self.cycles = max(1, min(most, math.ceil(stream_bytes / set_bytes)))
        for key, product in self.products.items():
            for _ in range(min(self.cycles, math.ceil(layer_counts[key])) - 1):
                check()
                product.weights.append(_copy(product.weights[0]))

    def warm_up(self, prefill: bool) -> None:
        """First calls initialise lazily (kernel selection, packing): untimed."""
        for p in [*self.products.values(), *([self.head] if self.head else [])]:
            linear(p.x1, p.weights[0], p.transposed)
        if prefill:
            for p in self.products.values():
                linear(p.xp, p.weights[0], p.transposed)

    def decode_pass(self) -> dict[Key, float]:
        """Milliseconds per product (the mean over the copies run) and for the head slice."""
        spent: dict[Key, list[float]] = {key: [] for key in self.products}
        started = time.perf_counter()
        for cycle in range(self.cycles):
            for key, p in self.products.items():
                t0 = time.perf_counter()
                linear(p.x1, p.weights[cycle % len(p.weights)], p.transposed)
                spent[key].append(time.perf_counter() - t0)
            if time.perf_counter() - started > _PASS_CAP_S:
                break
        out = {key: 1000 * sum(v) / len(v) for key, v in spent.items()}
        if self.head is not None:
            t0 = time.perf_counter()
            linear(self.head.x1, self.head.weights[0], self.head.transposed)
            out[HEAD] = 1000 * (time.perf_counter() - t0)
        return out

    def prefill_pass(self) -> dict[Key, float]:
        """Milliseconds per `PREFILL_ROWS`-row product (a prefill computes logits for its last
        row alone: no head)."""
        out = {}
        for key, p in self.products.items():
            t0 = time.perf_counter()
            linear(p.xp, p.weights[0], p.transposed)
            out[key] = 1000 * (time.perf_counter() - t0)
        return out


class _KVRun:
    """One KV dtype's attention, ready to time: every layer's own keys and values at
    `KV_CONTEXT` positions (distinct tensors, so a step reads them from memory as a long
    chat's does), queried as the model's attention queries them (the query heads sharing a
    KV head folded into rows; float32 queries cast to the cache's dtype, the result cast
    back, as `DecoderLayer._attend` does)."""

    def __init__(self, shapes: ModelShapes, kind: str, gen: torch.Generator):
        layers, heads, kv_heads, head_dim = shapes.kv
        dtype = _FLOAT[kind]
        shape = (1, kv_heads, KV_CONTEXT, head_dim)
        # A large model's every layer would be hundreds of MB: as many layers as fit
        # `_STREAM_MAX_BYTES` in float32 (keys and values) are timed, and scaled up.
        per_layer = 2 * kv_heads * KV_CONTEXT * head_dim * 4
        timed = max(1, min(layers, _STREAM_MAX_BYTES // per_layer))
        self.scale_up = layers / timed
        self.keys = [torch.randn(shape, generator=gen).to(dtype) for _ in range(timed)]
        self.values = [torch.randn(shape, generator=gen).to(dtype) for _ in range(timed)]
        group = heads // kv_heads
        self.q1 = torch.randn(1, kv_heads, group, head_dim, generator=gen)
        self.q1_per_head = self.q1.view(1, heads, 1, head_dim)  # the same queries, one a row
        self.qp = torch.randn(1, kv_heads, group * KV_PREFILL_ROWS, head_dim, generator=gen)
        self.scale = head_dim ** -0.5
        self.dtype = dtype

    def _attend(self, q: torch.Tensor, layer: int, keys: int) -> torch.Tensor:
        k, v = self.keys[layer], self.values[layer]
        if keys < k.shape[2]:
            k, v = k[:, :, :keys], v[:, :, :keys]
        per_head = q.shape[1] != k.shape[1]  # (query heads sharing a KV head: enable_gqa)
        out = torch.nn.functional.scaled_dot_product_attention(q.to(self.dtype), k, v, scale=self.scale,
                                                               enable_gqa=per_head)
        return out.to(q.dtype)

    def warm_up(self) -> None:
        self._attend(self.q1, 0, KV_CONTEXT)
        self._attend(self.qp, 0, 2 * KV_PREFILL_ROWS)
        try:
            self._attend(self.q1_per_head, 0, KV_CONTEXT)
        except Exception:  # noqa: BLE001 - its timing fails alike and is dropped (`_measure`)
            pass

    def decode_pass(self, per_head: bool = False) -> float:
        """Milliseconds for one decode step's attention, every layer, asked per KV head (the
        queries sharing it as rows) or `per_head`."""
        q = self.q1_per_head if per_head else self.q1
        t0 = time.perf_counter()
        for layer in range(len(self.keys)):
            self._attend(q, layer, KV_CONTEXT)
        return 1000 * (time.perf_counter() - t0) * self.scale_up

    def prefill_pass(self) -> float:
        """Milliseconds for one layer's prefill-chunk attention (the chunk and as many keys
        before it)."""
        t0 = time.perf_counter()
        self._attend(self.qp, 0, 2 * KV_PREFILL_ROWS)
        return 1000 * (time.perf_counter() - t0)


_PROBE: torch.Tensor | None = None


def _probe_ms() -> float:
    """How long waking torch's threads takes: the median of three fills of a tensor just big
    enough to be split between them (a few microseconds when they have their cores)."""
    global _PROBE
    if _PROBE is None:
        _PROBE = torch.empty(1 << 17)
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        _PROBE.fill_(1.0)
        samples.append(1000 * (time.perf_counter() - t0))
    return statistics.median(samples)


# ---- measuring -----------------------------------------------------------------------------


def spread(samples: list[float]) -> float:
    """Relative spread of repeated timings: (high - low) / median, with the single highest
    and lowest dropped once there are five or more (one burst is not noise)."""
    ordered = sorted(samples)
    if len(ordered) >= 5:
        ordered = ordered[1:-1]
    mid = statistics.median(ordered)
    return (ordered[-1] - ordered[0]) / mid if mid > 0 else 0.0


@dataclass
class Measurement:
    """Median milliseconds per kind (decode step, prefill chunk), each kind's spread, and the
    share of timings whose threads stalled (`stalled`, with the median probe in `stall_ms`)."""

    decode_ms: dict[str, float]
    prefill_ms: dict[str, float]
    decode_spread: dict[str, float] = field(default_factory=dict)
    prefill_spread: dict[str, float] = field(default_factory=dict)
    stalled: float = 0.0
    stall_ms: float = 0.0  # the median wake-up of the stalled probes
    timed_once: tuple[str, ...] = ()  # kinds cut after the first repetition (SLOW_CUT)
    # The KV cache's dtypes: a decode step's attention and one prefill chunk's, median ms,
    # and the larger spread of the two per dtype (empty when the model's shapes lack `kv`).
    kv_ms: dict[str, float] = field(default_factory=dict)
    kv_prefill_ms: dict[str, float] = field(default_factory=dict)
    kv_spread: dict[str, float] = field(default_factory=dict)
    # Kinds (and "kv <dtype>") whose kernels raised on this machine: left out, with the error.
    failed: dict[str, str] = field(default_factory=dict)
    # The same decode step's attention asked per query head, and its spread (models whose
    # query heads share KV heads; `pick_layout`).
    kv_per_head_ms: dict[str, float] = field(default_factory=dict)
    kv_per_head_spread: dict[str, float] = field(default_factory=dict)

    @property
    def ran(self) -> bool:
        """Whether some kind's kernels ran for decode and for prefill (False: all raised)."""
        return bool(self.decode_ms and self.prefill_ms)


def _totals(shapes: ModelShapes, per_kind: dict[str, dict[Key, float]], prefill: bool
            ) -> dict[str, float]:
    """Each kind's milliseconds per step (or prefill chunk) from its per-product times: counts
    times times, plus a 4-bit kind's float products at the fastest float kind's times."""
    def own(kind: str, times: dict[Key, float]) -> float:
        counts = _counts(shapes, kind).own
        return sum(c * times[key] for key, c in counts.items()
                   if key in times and not (prefill and key == HEAD))

    floats = {k: own(k, t) for k, t in per_kind.items() if k in _FLOAT}
    best = min(floats, key=floats.__getitem__) if floats else None
    out = dict(floats)
    for kind, times in per_kind.items():
        if kind in _FLOAT:
            continue
        borrowed = _counts(shapes, kind).borrowed
        out[kind] = own(kind, times) + (0.0 if best is None else sum(
            c * per_kind[best].get(key, 0.0) for key, c in borrowed.items()
            if not (prefill and key == HEAD)))
    return out


def measure(shapes: ModelShapes, kinds=KINDS, reps: int | None = None,
            busy: Callable[[], bool] | None = None, prefill_kinds=None) -> Measurement | None:
    """`_measure`, then the C heap's free pages go back to the system: its timing weights
    (hundreds of MB) would otherwise stay resident for the rest of the session (`heap`)."""
    try:
        return _measure(shapes, kinds, reps, busy, prefill_kinds)
    finally:
        release_freed_memory()


def _measure(shapes: ModelShapes, kinds, reps: int | None, busy: Callable[[], bool] | None,
             prefill_kinds) -> Measurement | None:
    """Time `kinds` for decode (and `prefill_kinds`, by default those of `kinds` that are
    prefill candidates, for prefill) interleaved: each of `reps` repetitions times every
    kind once, in an order rotated per repetition (a burst of load hits every kind alike),
    after probing the threads' wake-up (`_probe_ms`; when more than `STALLED_MAX` of the first
    repetition's probes stalled, it stops there); a kind's figure is its median. None when
    `busy()` turns true between timings (the engine got work): such a measurement would be
    disturbed, and the engine must not wait for it.

    A 4-bit kind's float products are timed by the float kinds (the default is added when no
    float kind is among `kinds`)."""
    gen = torch.Generator().manual_seed(0)
    reps = REPS if reps is None else reps
    decode = list(dict.fromkeys(kinds))
    prefill = [k for k in dict.fromkeys(decode if prefill_kinds is None else prefill_kinds)
               if k in PREFILL_KINDS]
    for chosen in (decode, prefill):
        borrows = any(_counts(shapes, k).borrowed for k in chosen if k not in _FLOAT)
        if borrows and not any(k in _FLOAT for k in chosen):
            chosen.append(DEFAULT)
    timed = list(dict.fromkeys(decode + prefill))
    stream = min(2 * last_level_cache_bytes(), _STREAM_MAX_BYTES)
    samples_d: dict[str, list[dict]] = {k: [] for k in decode}
    samples_p: dict[str, list[dict]] = {k: [] for k in prefill}
    kv_kinds = list(KV_KINDS) if all(shapes.kv) else []
    samples_kv: dict[str, list[tuple[float, float]]] = {k: [] for k in kv_kinds}
    grouped = bool(kv_kinds) and shapes.kv[1] > shapes.kv[2]  # query heads share KV heads
    samples_kvh: dict[str, list[float]] = {k: [] for k in kv_kinds if grouped}
    probes: list[float] = []
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def inputs(k: int) -> tuple[torch.Tensor, torch.Tensor]:  # one row, PREFILL_ROWS rows
        if k not in shared:
            shared[k] = (torch.randn(1, k, generator=gen), torch.randn(PREFILL_ROWS, k, generator=gen))
        return shared[k]

    # A kernel that raises on this machine (a torch build, a CPU, a kind that cannot run here)
    # rules out its kind, never the load: the others are measured and chosen from.
    failed: dict[str, str] = {}

    def fails(name: str, exc: Exception) -> None:
        failed[name] = f"{type(exc).__name__}: {exc}"[:200]

    with torch.inference_mode():
        # Setting up (~0.5 s of every core: weights made, copied past the cache, warmed up)
        # gives way to the engine too, between steps: a request arriving then (a person
        # sending a message a second after a relaunch) would otherwise share the cores with
        # it, and the window's GUI thread with both (stalls of 60-90 ms measured).
        runs: dict[str, _KindRun] = {}
        for kind in timed:
            try:
                runs[kind] = _KindRun(shapes, kind, gen, stream, inputs, busy)
            except _Interrupted:
                return None
            except Exception as exc:
                fails(kind, exc)
        kv_runs: dict[str, _KVRun] = {}
        for kind in kv_kinds:
            if busy is not None and busy():
                return None
            try:
                kv_runs[kind] = _KVRun(shapes, kind, gen)
            except Exception as exc:
                fails(f"kv {kind}", exc)
        for kind, run in list(runs.items()):
            if busy is not None and busy():
                return None
            try:
                run.warm_up(kind in prefill)
            except Exception as exc:
                fails(kind, exc)
                del runs[kind]
        for kind, run in list(kv_runs.items()):
            try:
                run.warm_up()
            except Exception as exc:
                fails(f"kv {kind}", exc)
                del kv_runs[kind]
        active_d = {k for k in decode if k in runs}
        active_p = {k for k in prefill if k in runs}
        for rep in range(reps):
            for kind in _rotated(timed, rep):
                if kind not in active_d and kind not in active_p:
                    continue
                if busy is not None and busy():
                    return None
                probes.append(_probe_ms())
                try:
                    if kind in active_d:
                        samples_d[kind].append(runs[kind].decode_pass())
                    if kind in active_p:
                        samples_p[kind].append(runs[kind].prefill_pass())
                except Exception as exc:
                    fails(kind, exc)
                    active_d.discard(kind)
                    active_p.discard(kind)
                    for samples in (samples_d, samples_p):
                        if kind in samples:
                            samples[kind] = []
            for kind in _rotated([k for k in kv_kinds if k in kv_runs], rep):
                if busy is not None and busy():
                    return None
                probes.append(_probe_ms())
                try:
                    run = kv_runs[kind]
                    samples_kv[kind].append((run.decode_pass(), run.prefill_pass()))
                except Exception as exc:
                    fails(f"kv {kind}", exc)
                    del kv_runs[kind]
                    samples_kv[kind] = []
                    samples_kvh.pop(kind, None)
                    continue
                if kind in samples_kvh:  # after them, so theirs are timed as they always were
                    try:
                        samples_kvh[kind].append(run.decode_pass(per_head=True))
                    except Exception:  # per head cannot run here: per KV head, as before
                        del samples_kvh[kind]
            if rep == 0:  # a kind that cannot win is not timed again
                for samples, active, is_prefill in ((samples_d, active_d, False),
                                                    (samples_p, active_p, True)):
                    first = _totals(shapes, {k: s[0] for k, s in samples.items() if s}, is_prefill)
                    fastest = min(first.values(), default=0.0)
                    active -= {k for k, ms in first.items() if ms > SLOW_CUT * fastest
                               and k != DEFAULT}
                if sum(p > STALL_MS for p in probes) > STALLED_MAX * len(probes):
                    break  # stalled already: unusable whatever follows (each stall costs ms)
    decode_ms, decode_spread = _figures(shapes, samples_d, False)
    prefill_ms, prefill_spread = _figures(shapes, samples_p, True)
    once = tuple(k for k in timed if k not in active_d and k not in active_p and k not in failed)
    kv_ms, kv_prefill_ms, kv_spread = {}, {}, {}
    for kind, pairs in samples_kv.items():
        if pairs:
            kv_ms[kind] = round(statistics.median(d for d, _ in pairs), 3)
            kv_prefill_ms[kind] = round(statistics.median(p for _, p in pairs), 3)
            kv_spread[kind] = round(max(spread([d for d, _ in pairs]), spread([p for _, p in pairs])), 3)
    kv_per_head_ms = {k: round(statistics.median(t), 3) for k, t in samples_kvh.items() if t}
    kv_per_head_spread = {k: round(spread(t), 3) for k, t in samples_kvh.items() if t}
    return Measurement(decode_ms, prefill_ms, decode_spread, prefill_spread,
                       round(sum(p > STALL_MS for p in probes) / max(len(probes), 1), 3),
                       round(statistics.median([p for p in probes if p > STALL_MS] or [0.0]), 3),
                       once, kv_ms, kv_prefill_ms, kv_spread, failed, kv_per_head_ms,
                       kv_per_head_spread)


def _rotated(kinds: list[str], rep: int) -> list[str]:
    """`kinds` in the order of repetition `rep`: each starts first in turn."""
    turn = rep % len(kinds) if kinds else 0
    return kinds[turn:] + kinds[:turn]


def _figures(shapes: ModelShapes, samples: dict[str, list[dict]], prefill: bool
             ) -> tuple[dict[str, float], dict[str, float]]:
    """Each kind's median per-product times summed into a step's (or chunk's) milliseconds,
    and the spread of its repetitions' own totals."""
    medians = {k: {key: statistics.median(s[key] for s in reps) for key in reps[0]}
               for k, reps in samples.items() if reps}
    totals = _totals(shapes, medians, prefill)
    spreads = {}
    for kind, reps in samples.items():
        if reps:
            per_rep = [_totals(shapes, {**medians, kind: s}, prefill)[kind] for s in reps]
            spreads[kind] = round(spread(per_rep), 3)
    return {k: round(ms, 3) for k, ms in totals.items()}, spreads


# ---- choosing ------------------------------------------------------------------------------


def _allowed(shapes: ModelShapes, kinds=KINDS, compile: bool = True) -> list[str]:
    """Of `kinds`, those this model and machine can run (the 8-bit activation kernel is
    compiled to find out, when asked about; without `compile`, only a kernel compiled or
    saved already counts)."""
    allowed = [k for k in kinds if k not in FAILS_QUALITY]
    if shapes.int4_fraction == 0 or not int4_kernel_available():
        allowed = [k for k in allowed if not k.startswith("int4")]
    if INT8_KIND in allowed and not (int8_products.available() if compile else int8_products.ready()):
        allowed = [k for k in allowed if k != INT8_KIND]
    return allowed


def _pick(times: dict[str, float], allowed: list[str], noise: float) -> str:
    """The fastest allowed kind, if it beats the default by more than the noise; else the
    default. A kind is never chosen for being available, only for being measured faster."""
    timed = [k for k in allowed if k in times]
    best = min(timed, key=times.__getitem__)
    if DEFAULT in timed and best != DEFAULT:
        if times[best] > times[DEFAULT] * (1 - max(MIN_GAIN, noise)):
            return DEFAULT
    return best


def choose(m: Measurement, shapes: ModelShapes) -> Policy:
    """The fastest kind that meets the quality bar and beats the default beyond noise, for
    decode and for prefill."""
    decode_ms, prefill_ms = m.decode_ms, m.prefill_ms
    allowed = [k for k in decode_ms if k in _allowed(shapes)]
    decode = _pick(decode_ms, allowed, _noise(decode_ms, m.decode_spread, allowed))
    prefill_allowed = [k for k in allowed if k in prefill_ms]
    prefill = _pick(prefill_ms, prefill_allowed, _noise(prefill_ms, m.prefill_spread, prefill_allowed))
    if decode.startswith("int4") and prefill.startswith("int4") and prefill != decode:
        # One set of 4-bit planes, one activation dtype: the prefill goes to a float copy.
        prefill = _pick(prefill_ms, [k for k in prefill_allowed if k in _FLOAT], 0.0)
    noise = max(_noise(decode_ms, m.decode_spread, allowed),
                _noise(prefill_ms, m.prefill_spread, prefill_allowed))
    label = decode if decode == prefill else f"{decode} decode, {prefill} prefill"
    kv, kv_why = pick_kv(m, prefill_ms.get(prefill))
    if kv != KV_DEFAULT:
        label += f", {kv} KV"
    per_head, layout_why = pick_layout(m, kv)
    failed = "".join(f"; {kind} left out, its kernels failed here ({error})"
                     for kind, error in m.failed.items() if not kind.startswith("kv "))
    return Policy(decode, prefill, label, _reason(decode_ms, prefill_ms, decode, prefill, allowed,
                                                  shapes, noise) + failed + kv_why + layout_why,
                  decode_ms, prefill_ms, noise=round(noise, 3), measured_at=time.time(),
                  status=MEASURED, kv=kv, kv_ms=dict(m.kv_ms), kv_per_head=per_head,
                  kv_unsettled=_kv_noise(m) > ERRATIC)


def pick_kv(m: Measurement, chunk_ms: float | None = None) -> tuple[str, str]:
    """The KV cache's dtype from a measurement, and a clause saying why: bfloat16 when it beats
    float32 by more than the noise (and `MIN_GAIN`) in a decode step's attention or a prefill
    chunk's, and is no slower beyond the noise in the other -- or, faster at decode, its
    prefill chunk's attention is slower by at most `KV_PREFILL_SHARE` of the whole chunk's
    time (`chunk_ms`, the chosen prefill kind's products): a decode step's attention is paid
    on every token, a chunk's once per 512 prompt tokens beside products that take ~50-100x
    longer. float32 otherwise (also when the timings are erratic, or missing)."""
    broken = [f"{k[3:]} attention failed here ({error})" for k, error in m.failed.items()
              if k.startswith("kv ")]
    if broken:
        return KV_DEFAULT, f"; KV cache {KV_DEFAULT} ({'; '.join(broken)})"
    if not all(k in m.kv_ms and k in m.kv_prefill_ms for k in KV_KINDS):
        return KV_DEFAULT, ""
    noise = _kv_noise(m)
    figures = (f"attention over {KV_CONTEXT:,} positions {m.kv_ms['bfloat16']:.1f} ms a step "
               f"in bfloat16, {m.kv_ms['float32']:.1f} ms in float32; a {KV_PREFILL_ROWS}-row "
               f"chunk's {m.kv_prefill_ms['bfloat16']:.1f} / {m.kv_prefill_ms['float32']:.1f} ms")
    if noise > ERRATIC:
        return KV_DEFAULT, f"; KV cache float32 (its timings were erratic: {figures})"
    margin = max(MIN_GAIN, noise)

    def faster(times: dict[str, float]) -> bool:
        return times["bfloat16"] < times["float32"] * (1 - margin)

    if (any(faster(t) for t in (m.kv_ms, m.kv_prefill_ms))
            and all(_kv_keeps_up(m, t, "bfloat16", "float32") for t in (m.kv_ms, m.kv_prefill_ms))):
        return "bfloat16", f"; KV cache bfloat16 ({figures})"
    prefill_extra = m.kv_prefill_ms["bfloat16"] - m.kv_prefill_ms["float32"]
    if faster(m.kv_ms) and chunk_ms and prefill_extra <= chunk_ms * KV_PREFILL_SHARE:
        return "bfloat16", (f"; KV cache bfloat16 ({figures}; the chunk's extra "
                            f"{prefill_extra:.1f} ms is {prefill_extra / chunk_ms:.1%} of its "
                            f"{chunk_ms:.0f} ms)")
    return KV_DEFAULT, f"; KV cache float32 ({figures})"


def _kv_noise(m: Measurement) -> float:
    """The larger spread of the KV dtypes' attention timings (0 when they were not timed)."""
    return max((m.kv_spread.get(k, 0.0) for k in KV_KINDS), default=0.0)


def pick_layout(m: Measurement, kv: str) -> tuple[bool, str]:
    """Whether long decode steps ask attention per query head (from `PER_HEAD_FROM` keys),
    and a clause saying why: only when that beat asking per KV head, in the cache's dtype
    `kv` at `KV_CONTEXT` positions, by more than the noise of either (and `MIN_GAIN`)."""
    if kv not in m.kv_per_head_ms or kv not in m.kv_ms:
        return False, ""  # one query head a KV head (nothing to fold), or not measured
    per_head, grouped = m.kv_per_head_ms[kv], m.kv_ms[kv]
    margin = max(MIN_GAIN, m.kv_per_head_spread.get(kv, 0.0), m.kv_spread.get(kv, 0.0))
    figures = f"{per_head:.1f} against {grouped:.1f} ms over {KV_CONTEXT:,} positions"
    if per_head < grouped * (1 - margin):
        return True, f"; decode attention per query head from {PER_HEAD_FROM:,} positions ({figures})"
    return False, f"; decode attention per KV head (per query head {figures})"


def _kv_keeps_up(m: Measurement, times: dict[str, float], kind: str, against: str) -> bool:
    """Whether `kind`'s attention in `times` (m.kv_ms or m.kv_prefill_ms) is no slower than
    `against`'s beyond noise."""
    margin = max(MIN_GAIN, m.kv_spread.get(kind, 0.0), m.kv_spread.get(against, 0.0))
    return times.get(kind, math.inf) <= times.get(against, 0.0) * (1 + margin)


def _noise(times: dict[str, float], spreads: dict[str, float], allowed: list[str]) -> float:
    """The largest spread among the fastest allowed kind and those within `ERRATIC` of it
    (the default and the runner-up included when they are): what a difference between them
    must exceed to mean anything. A kind timed far behind cannot overturn the order, so its
    noise does not count (as in `still_holds`): a burst during the default's timings, 2.7x
    behind Gemma 3 270M's 4-bit decode, need not make the whole measurement "erratic"."""
    timed = [k for k in allowed if k in times]
    if not timed:
        return 0.0
    best = min(times[k] for k in timed)
    return max(spreads.get(k, 0.0) for k in timed if times[k] <= best * (1 + ERRATIC))


def _reason(decode_ms, prefill_ms, decode, prefill, allowed, shapes, noise) -> str:
    def versus(times: dict[str, float], chosen: str) -> str:
        other = min((k for k in allowed if k in times and k != chosen), key=times.__getitem__,
                    default=None)
        if other is None:
            return ""
        if chosen == DEFAULT and times[other] < times[chosen]:
            return f" ({other} {times[other]:.1f} ms, not faster beyond noise)"
        return f" ({other} {times[other]:.1f} ms)"

    reason = (f"measured on {cpu_identity()}: decode step {decode_ms[decode]:.1f} ms with {decode}"
              + versus(decode_ms, decode)
              + f"; {PREFILL_ROWS}-row prefill {prefill_ms[prefill]:.1f} ms with {prefill}"
              + versus(prefill_ms, prefill) + f"; noise {noise:.0%}")
    if decode.startswith("int4") and shapes.int4_fraction < 1:
        reason += f"; {shapes.int4_fraction:.0%} of the weights fit the 4-bit kernel"
    return reason


def unusable(m: Measurement) -> str | None:
    """Why a measurement's figures cannot be acted on (None: they can): its threads stalled
    (see the module docstring's stall rule)."""
    if not m.ran:
        return f"no kind's kernels ran here ({'; '.join(f'{k}: {e}' for k, e in m.failed.items())})"
    if m.stalled > STALLED_MAX:
        return (f"the threads waited for cores other programs held in {m.stalled:.0%} of the "
                f"timings (waking them took {m.stall_ms:.1f} ms there, normally microseconds)")
    return None


# ---- cached, validated, measured -----------------------------------------------------------


def cached_policy(shapes: ModelShapes, cache_dir: Path) -> Policy | None:
    """The cached policy for this measurement, CPU, torch and model, unchecked, or None."""
    entry = read_cache(cache_dir / CACHE_FILE).get(cache_key(shapes))
    return _policy_from(entry) if isinstance(entry, dict) else None


_THREADS = re.compile(r"\| (\d+) threads \|")  # cpu_identity's part of a cache key
_ANY_THREADS = "| * threads |"


def borrowed_policy(shapes: ModelShapes, cache_dir: Path) -> Policy | None:
    """Until this model is measured: the choice measured most recently for another model on
    this CPU (same measurement, torch and threads; failing that, another thread count -- a
    busy machine's start may have measured with one), when its kinds are allowed for this
    one; None when there is none. Which kernels are fast is mostly the CPU's doing, so a second
    model starts in its likely format instead of the default (Gemma 3 270M loaded after
    SmolLM2 on a 2-core AMX Xeon: 16.5-17.5 tok/s in float16 until the background
    measurement ran, 37-41 in the 4-bit format both measure fastest). The background tuner
    still measures this model and swaps in its own choice when that differs (status
    BORROWED)."""
    prefix = cache_key(shapes).removesuffix(shapes.key())
    any_threads = _THREADS.sub(_ANY_THREADS, prefix, count=1)
    # (nothing compiled for it: a kernel not ready now would cost a first load ~4 s)
    allowed = _allowed(shapes, compile=False)
    best, rank, source, threads = None, None, "", ""
    for key, entry in read_cache(cache_dir / CACHE_FILE).items():
        norm = _THREADS.sub(_ANY_THREADS, key, count=1)  # the CPU's thread count made "*"
        if not isinstance(entry, dict) or not norm.startswith(any_threads):
            continue
        policy = _policy_from(entry)
        if policy is None or policy.decode not in allowed or policy.prefill not in allowed:
            continue
        same = key.startswith(prefix)
        if rank is not None and (same, policy.measured_at) <= rank:
            continue  # this thread count first, then the newest
        best, rank = policy, (same, policy.measured_at)
        source = norm[len(any_threads):].split("|", 1)[0]
        found = _THREADS.search(key)
        if same or found is None:
            threads = ""
        else:
            threads = f" on {found.group(1)} thread{'s' * (found.group(1) != '1')}"
    if best is None:
        return None
    # The attention layout is not borrowed: which is faster follows the model's head shapes
    # (SmolLM2's and Gemma 3's differ) more than the CPU.
    return dataclasses.replace(
        best, reason=f"{best.label} as measured on this CPU for {source}{threads}, until this "
                     "model is measured (in the background)", cached=False, status=BORROWED,
        kv_per_head=False)


def _store(shapes: ModelShapes, cache_dir: Path, policy: Policy) -> None:
    """Cache `policy`; entries of another measurement (version, rows, kinds) are pruned."""
    path = cache_dir / CACHE_FILE
    current = f"{measurement_id()} | "
    entries = {k: v for k, v in read_cache(path).items() if k.startswith(current)}
    entries[cache_key(shapes)] = {k: v for k, v in asdict(policy).items()
                                  if k not in ("cached", "status")}
    try:
        write_cache(path, entries=entries)
    except OSError:
        pass  # a read-only data folder only costs a re-measurement next time


def measure_and_choose(shapes: ModelShapes, cache_dir: Path,
                       busy: Callable[[], bool] | None = None) -> Policy | None:
    """A full measurement and the choice from it, cached when its timings were steady. When
    they were erratic or stalled, the machine is measured again, up to `MEASURE_TRIES`
    times in all; when no try was usable, or they ran past `BUDGET_S` (a machine this busy
    times nothing reliably), the default is returned (status NOT_MEASURED), saying why, and
    nothing is cached. None when `busy()` interrupted it."""
    started = time.monotonic()
    over = lambda: time.monotonic() - started > BUDGET_S  # noqa: E731
    why, measured = None, 0
    for _ in range(MEASURE_TRIES):
        m = measure(shapes, busy=lambda: (busy is not None and busy()) or over())
        if m is None:
            if busy is not None and busy():
                return None
            break  # past the budget: the last finished measurement's reason, if any, stands
        measured += 1
        if not m.ran:
            why = unusable(m)
            break  # nothing ran: measuring again would not change that
        policy = choose(m, shapes)
        why = _unusable_why(m, policy)
        if why is None:
            _store(shapes, cache_dir, policy)
            return policy
    failed = m.failed if m is not None else ()
    if why is None:
        return default_policy(f"kept: the measurement ran past {BUDGET_S:.0f} s on a busy "
                              "machine (nothing cached; measured again next load)", shapes, failed)
    times = "" if measured == 1 else f" after {measured} measurements"
    return default_policy(f"kept: {why}; nothing cached{times}, measured again next load",
                          shapes, failed)


def _unusable_why(m: Measurement, policy: Policy) -> str | None:
    """Why a measurement and the policy chosen from it cannot be kept (None: they can)."""
    stalled = unusable(m)
    if stalled:
        return f"{stalled}; what was seen: {policy.reason}"
    if policy.noise > ERRATIC:
        return f"timings too erratic to choose (noise {policy.noise:.0%}; {policy.reason})"
    return None


HOLDS, CHANGED, UNCLEAR, INTERRUPTED = "holds", "changed", "unclear", "interrupted"


def check(policy: Policy, shapes: ModelShapes, busy: Callable[[], bool] | None = None
          ) -> tuple[str, str]:
    """Whether a cached choice still holds, and what was seen. CHANGED when the entry is older
    than `MAX_AGE_DAYS`, or when a re-timing (`VALIDATE_REPS` repetitions of every allowed
    decode kind, and of the prefill choice, its runner-up by the cached figures and the
    default) puts another kind ahead beyond noise or finds the choice's own time `DRIFT`
    times off its cached figure (an entry measured under load, or poisoned, is caught even
    when its order ranked the real winner last); UNCLEAR when the re-timing was itself
    erratic or stalled (the earlier measurement is kept); INTERRUPTED when `busy()` stopped
    it."""
    age_days = (time.time() - policy.measured_at) / 86_400
    if age_days > MAX_AGE_DAYS:
        return CHANGED, f"the entry is {age_days:.0f} days old"
    if policy.kv_unsettled:
        # A re-timing compares decode attention only; a float32 cache kept for erratic
        # timings could then stand for months beside a bfloat16 prefill 3-4x faster.
        return CHANGED, "its KV cache timings were erratic when measured"
    allowed = _allowed(shapes)
    prefill_allowed = [k for k in allowed if k in PREFILL_KINDS]
    ranked = sorted((k for k in policy.prefill_ms if k in prefill_allowed and k != policy.prefill),
                    key=policy.prefill_ms.__getitem__)
    prefill = [k for k in prefill_allowed if k in {policy.prefill, DEFAULT, *ranked[:1]}]
    m = measure(shapes, allowed, reps=VALIDATE_REPS, busy=busy, prefill_kinds=prefill)
    if m is None:
        return INTERRUPTED, "interrupted"
    return judge(policy, m)


def judge(policy: Policy, m: Measurement) -> tuple[str, str]:
    """A re-timing's verdict on a cached policy (see `check`), and what was seen."""
    for chosen in (policy.decode, policy.prefill, f"kv {policy.kv}"):
        if chosen in m.failed:
            return CHANGED, f"{chosen} failed here now ({m.failed[chosen]})"
    stalled = unusable(m)
    if stalled:
        return UNCLEAR, stalled
    for what, times, cached, chosen in (("decode step", m.decode_ms, policy.decode_ms, policy.decode),
                                        ("prefill", m.prefill_ms, policy.prefill_ms, policy.prefill),
                                        ("KV attention", m.kv_ms, policy.kv_ms, policy.kv)):
        if chosen in times and cached.get(chosen, 0) > 0:
            ratio = times[chosen] / cached[chosen]
            if ratio > DRIFT or ratio < 1 / DRIFT:
                return CHANGED, (f"{chosen} {what} {times[chosen]:.1f} ms now against "
                                 f"{cached[chosen]:.1f} ms cached")
    holds = still_holds(policy, m)
    if holds is None:
        return UNCLEAR, "the re-timing was erratic"
    if not holds:
        return CHANGED, "another kind is now faster beyond noise"
    return HOLDS, "re-timed, it holds"


def still_holds(policy: Policy, m: Measurement) -> bool | None:
    """Whether a re-timing `m` keeps the policy's choices ahead of the other kinds it timed
    (or behind by no more than the noise); None when the timings that decide it (the choice's
    and those of the kinds within `ERRATIC` of it or faster) are erratic. A kind timed far
    behind cannot overturn the choice, so its noise does not matter; nor can a KV dtype other
    than the default whose prefill attention is slower beyond noise (`pick_kv` would not
    take it)."""
    kv_ms = {k: ms for k, ms in m.kv_ms.items()
             if k in (policy.kv, KV_DEFAULT) or _kv_keeps_up(m, m.kv_prefill_ms, k, policy.kv)}
    for times, spreads, chosen in ((m.decode_ms, m.decode_spread, policy.decode),
                                   (m.prefill_ms, m.prefill_spread, policy.prefill),
                                   (kv_ms, m.kv_spread, policy.kv)):
        if chosen not in times:
            continue
        rivals = [k for k in times if k != chosen
                  # an int4 decode leaves the prefill to a float copy (one set of planes)
                  and not (times is m.prefill_ms and policy.decode.startswith("int4")
                           and k.startswith("int4"))]
        near = [chosen, *(k for k in rivals if times[k] <= times[chosen] * (1 + ERRATIC))]
        if max(spreads.get(k, 0.0) for k in near) > ERRATIC:
            return None
        margin = max([MIN_GAIN, *(spreads.get(k, 0.0) for k in near)])
        if any(times[k] < times[chosen] * (1 - margin) for k in rivals):
            return False
    if policy.kv in m.kv_per_head_ms and policy.kv in m.kv_ms:
        per_head, grouped = m.kv_per_head_ms[policy.kv], m.kv_ms[policy.kv]
        chosen, other = (per_head, grouped) if policy.kv_per_head else (grouped, per_head)
        spreads = (m.kv_per_head_spread.get(policy.kv, 0.0), m.kv_spread.get(policy.kv, 0.0))
        if max(spreads) > ERRATIC:
            return None
        if other < chosen * (1 - max(MIN_GAIN, *spreads)):
            return False  # the other layout now wins beyond noise
    return True


def tune(shapes: ModelShapes, cache_dir: Path, busy: Callable[[], bool] | None = None
         ) -> Policy | None:
    """The cached policy if it is checked to hold (`check`), else a fresh measurement (cached
    when usable). When the check found the entry changed but the fresh measurement is
    unusable, the cached choice is kept (status KEPT), saying so: a machine too busy to
    measure is too busy to prove the old figures wrong. None when interrupted; the caller
    (the session's background tuner) tries again later."""
    cached = cached_policy(shapes, cache_dir)
    detail = ""
    if cached is not None:
        verdict, detail = check(cached, shapes, busy)
        if verdict == INTERRUPTED:
            return None
        if verdict in (HOLDS, UNCLEAR):
            cached.status = CHECKED if verdict == HOLDS else CHECK_UNCLEAR
            cached.reason += (" (cached, checked)" if verdict == HOLDS
                              else f" (cached; re-check inconclusive: {detail})")
            return cached
    fresh = measure_and_choose(shapes, cache_dir, busy)
    if fresh is None or cached is None:
        return fresh
    if fresh.status != MEASURED:
        cached.status = KEPT
        cached.reason += (f" (cached, kept: the check found {detail}, but the re-measurement "
                          f"was unusable: {fresh.reason.split(f'{DEFAULT_SAYS} kept: ', 1)[-1]})")
        return cached
    fresh.reason += f" (measured again: {detail})"
    return fresh


def policy_for(shapes: ModelShapes, cache_dir: Path) -> Policy:
    """What a command-line load (chat, serve, bench, the comparison script) uses before it
    loads: the cached policy once checked (`tune`), or a fresh measurement (cached when usable).

    It checks the cached entry, unlike the window's load, because nothing else would: the
    window loads the cached choice at once and its session checks it in the background, but
    a command-line process has no background tuner, so an entry measured under load (or
    before a fix to the measurement) would be trusted for good, costing on every token what
    a check costs once (about a second for the built-in models)."""
    policy = tune(shapes, cache_dir)
    assert policy is not None  # nothing can interrupt it
    return policy


# ---- a model file's shapes -----------------------------------------------------------------

_SHAPES_VERSION = 6  # of the "files" section's entries (2: joined products, planes per weight; 3: kv;
#                     4: screened heads are one plane; 5: Q2_K/Q3_K/Q6_K are two planes;
#                     6: heads screened from 32,768 tokens)


def shapes_for(path: Path, cache_dir: Path) -> ModelShapes | None:
    """`gguf_shapes`, remembered per file (path, size, modification time) in the cache, so a
    warm load parses the file's header once (in the loader), not twice. Entries of files that
    no longer exist are pruned."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        return None
    if path.is_dir():
        return None
    cache = cache_dir / CACHE_FILE
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    known = _read_section(cache, "files").get(key)
    if isinstance(known, dict) and known.get("version") == _SHAPES_VERSION:
        try:
            return ModelShapes(known["name"], {_dims(k, 2): int(v) for k, v in known["layers"].items()},
                               _dims("x".join(map(str, known["head"])), 2),
                               {_dims(k, 3): int(v) for k, v in known["int4_layers"].items()},
                               int(known["head_planes"]), _dims(known["kv"], 4))
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    shapes = gguf_shapes(path)
    if shapes is not None:
        files = {k: v for k, v in _read_section(cache, "files").items()
                 if Path(k.split("|", 1)[0]).exists()}
        files[key] = {"version": _SHAPES_VERSION, "name": shapes.name,
                      "layers": {f"{n}x{k}": c for (n, k), c in shapes.layers.items()},
                      "int4_layers": {f"{n}x{k}x{p}": c for (n, k, p), c in shapes.int4_layers.items()},
                      "head": list(shapes.head), "head_planes": shapes.head_planes,
                      "kv": "x".join(map(str, shapes.kv))}
        try:
            write_cache(cache, files=files)
        except OSError:
            pass
    return shapes


def _dims(text: str, count: int) -> tuple[int, ...]:
    dims = tuple(int(d) for d in text.split("x"))
    if len(dims) != count:
        raise ValueError(text)
    return dims


def _head_planes(ggml_type, rows: int) -> int:
    """The same for the output projection of `rows` tokens: a screened one is one plane
    (`quantized.screens`; its rescored rows, up to ~1,024 a step and 0.6-1.0 ms on a 2-core
    CPU, are not timed: the same for every 4-bit kind, and small beside what the screen
    saves)."""
    return 1 if screens(ggml_type, rows) else kernel_planes(ggml_type)


# Weights `finish_loading` joins into one product (`DecoderLayer.fuse_products`).
_JOINED = (("attn_q.weight", "attn_k.weight", "attn_v.weight"), ("ffn_gate.weight", "ffn_up.weight"))


def _layer_products(tensors: dict[str, tuple[int, int, int]]) -> tuple[list, list]:
    """One layer's products: [(out, in)] as a float load runs them, [(out, in, planes)] as a
    4-bit load does (joined only where `layers.fuse` joins: the same planes, and parts of
    64-row multiples when 4-bit; Q, K alone when V differs)."""
    rest = dict(tensors)
    floats, int4 = [], []

    def joins(parts) -> bool:
        planes = {p for _, _, p in parts}
        return len(planes) == 1 and (0 in planes or all(n % 64 == 0 for n, _, _ in parts))

    for group in _JOINED:
        if not all(name in rest for name in group):
            continue
        parts = [rest.pop(name) for name in group]
        floats.append((sum(n for n, _, _ in parts), parts[0][1]))
        for size in (len(parts), 2):
            if joins(parts[:size]):
                joined = parts[:size]
                int4.append((sum(n for n, _, _ in joined), joined[0][1], joined[0][2]))
                int4 += parts[size:]
                break
        else:
            int4 += parts
    floats += [(n, k) for n, k, _ in rest.values()]
    int4 += list(rest.values())
    return floats, int4


def gguf_shapes(path: Path) -> ModelShapes | None:
    """The linear products of a GGUF file's decoder, or None when it is not a GGUF file."""
    from app.models.gguf_file import GGUFFile

    if path.is_dir():
        return None
    per_layer: dict[int, dict[str, tuple[int, int, int]]] = {}
    head = None
    with GGUFFile(path) as gguf:
        name = gguf.get("general.name") if isinstance(gguf.get("general.name"), str) else path.stem
        kv = _kv_dims(gguf)
        for tensor, info in gguf.tensors.items():
            if len(info.shape) != 2:
                continue
            n, k = (int(d) for d in info.shape)
            if tensor == "output.weight" or (tensor == "token_embd.weight"
                                             and "output.weight" not in gguf.tensors):
                head = (n, k, _head_planes(info.ggml_type, n))  # an untied embedding is only gathered from
            elif tensor.startswith("blk."):
                _, index, rest = tensor.split(".", 2)
                per_layer.setdefault(int(index), {})[rest] = (n, k, kernel_planes(info.ggml_type))
    if head is None or not per_layer:
        return None
    layers: dict[tuple[int, int], int] = {}
    int4_layers: dict[tuple[int, int, int], int] = {}
    for tensors in per_layer.values():
        floats, int4 = _layer_products(tensors)
        for shape in floats:
            layers[shape] = layers.get(shape, 0) + 1
        for shape in int4:
            int4_layers[shape] = int4_layers.get(shape, 0) + 1
    return ModelShapes(name, layers, head[:2], int4_layers, head[2],
                       (len(per_layer), *kv[1:]) if kv[0] else kv)


def _kv_dims(gguf) -> tuple[int, int, int, int]:
    """(1, query heads, KV heads, head dim) from a GGUF file's attention metadata; zeros when
    it has none this can read (per-layer head counts, an unknown layout)."""
    arch = gguf.get("general.architecture")
    if not isinstance(arch, str):
        return (0, 0, 0, 0)
    heads = gguf.get(f"{arch}.attention.head_count")
    kv_heads = gguf.get(f"{arch}.attention.head_count_kv", heads)
    width = gguf.get(f"{arch}.embedding_length")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in (heads, kv_heads, width)) or heads % kv_heads:
        return (0, 0, 0, 0)
    head_dim = gguf.get(f"{arch}.attention.key_length", width // heads)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return (0, 0, 0, 0)
    return (1, heads, kv_heads, head_dim)
