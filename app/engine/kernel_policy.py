"""The CPU weight policy, measured on the machine rather than assumed.

CPUs differ more than any fixed rule can follow: on one with AVX-512-BF16/AMX a bfloat16
matrix product is the fastest prefill kernel torch has, on an AVX2-only one it is the
slowest (measured 14.7 s against float16's 3.2 s for a 1,024-token prefill). So the engine
times its candidate kernels on the model's own linear shapes, one row (decode) and
`PREFILL_ROWS` rows (prefill), through the same `linear()` the model runs, and picks per
product the fastest candidate that meets the quality bar. Decisions depend on those timings
alone, never on the CPU's name or on the kernels torch lists.

Robust against a busy machine (another process's burst must not stick for months):
  - candidates are timed interleaved (every repetition times every kind once, in rotated
    order), and each kind's figure is its median over the repetitions;
  - a kind other than the safe default (`DEFAULT`: float16, whose matrix-vector kernel is
    fast everywhere and whose many-row products upcast to float32) is chosen only when it
    beats the default by more than the measured noise (and at least `MIN_GAIN`);
  - a measurement whose timings are erratic (relative spread above `ERRATIC`) or that runs
    past `BUDGET_S` keeps the default and is never cached; an interrupted one (the engine
    got work) is thrown away;
  - a cached choice is checked cheaply on later loads (`validate`: the chosen kind and its
    runner-up re-timed for a few repetitions); it is measured again when they now disagree
    beyond noise or when the entry is older than `MAX_AGE_DAYS`.
The session measures in the background once a usable model is loaded (`tune`), so loading
never waits for it; the command line (`load_on(measure=True)`) measures before loading.
Results are cached per CPU (model name and torch's capability), torch version, thread
count and model shapes in `kernel_policy.json` in the data folder. A damaged cache file is
ignored and rewritten.

Candidates (`KINDS`): float32, bfloat16, float16, and the 4-bit weight-only kernel with
bfloat16 or float32 activations (`app.models.quantized`). Every one meets the quality bar
of a mean negative log-likelihood within 0.5% of the float32 model on a long public text
(scripts/measure_weight_quality.py reports the figures per format and model); a kind that
ever fails it belongs in `FAILS_QUALITY` and is never chosen.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from app.models.layers import WeightFormat, linear, weights_transposed
from app.models.quantized import (INT4_TYPES, ONE_PLANE_TYPES, QuantizedWeight, int4_kernel_available, pack_int4,
                                  quantize_synthetic)

CACHE_FILE = "kernel_policy.json"
# 2: interleaved medians with a noise figure and a date (entries of 1 could hold a
# measurement taken under load: measured again).
CACHE_VERSION = 2
# Rows of a timed prefill product: the engine's whole chunk (EngineConfig.prefill_chunk),
# where kernels part ways most (measured on one AVX-512 core, 2048x640: bfloat16 9.8 -> 19.8
# ms from 128 to 512 rows, the 4-bit kernel 6.4 -> 62.7 ms). Each distinct shape is timed
# once per repetition, so this stays well under a second per repetition for small models.
PREFILL_ROWS = 512
KINDS = ("float32", "bfloat16", "float16", "int4_bf16", "int4_f32")
# The 4-bit kernel with float32 activations is a decode candidate only: on CPUs measured so
# far its many-row product is 100x slower than any other (no vectorized path).
PREFILL_KINDS = ("float32", "bfloat16", "float16", "int4_bf16")
FAILS_QUALITY: frozenset[str] = frozenset()
# What runs before anything is measured, and what a candidate must beat: float16 weights
# (one copy; fast matrix-vector kernel on AVX2 and AVX-512 alike; many-row products upcast
# to float32, never bfloat16's slow AVX2 path).
DEFAULT = "float16"
REPS = 5  # interleaved repetitions of a full measurement
VALIDATE_REPS = 3
MIN_GAIN = 0.05  # a non-default kind must be at least this much faster than the default
ERRATIC = 0.25  # relative spread of a leading kind's timings above which nothing is cached
MAX_AGE_DAYS = 30
BUDGET_S = 30.0  # a full measurement's limit (about 2-5 s on an idle 2-core machine)
_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Rows of the output projection timed (its cost is scaled up to the whole vocabulary): the
# full product of a 262,144-token vocabulary would take most of the time budget on its own.
_HEAD_ROWS_TIMED = 8_192
# Two copies of the weights (decode and prefill kinds differ) only for model files up to
# this size (a Q4 file of 800 MB is ~1.4B parameters).
TWO_COPIES_MAX_FILE_BYTES = 800 * 2**20


@dataclass(frozen=True)
class ModelShapes:
    """The linear products of one decoding step: (out, in) -> how many per token."""

    name: str
    layers: dict[tuple[int, int], int]
    head: tuple[int, int]
    int4_fraction: float  # of the linear weights' elements whose blocks fit the 4-bit kernel
    int4_planes: float = 1.0  # mean 4-bit planes per fitting weight (Q5/Q8 blocks need two)

    def key(self) -> str:
        shapes = ",".join(f"{n}x{k}*{c}" for (n, k), c in sorted(self.layers.items()))
        return (f"{self.name}|{shapes}|head {self.head[0]}x{self.head[1]}"
                f"|int4 {self.int4_fraction:.3f}x{self.int4_planes:.2f}")


@dataclass
class Policy:
    """What to store and multiply with: the decode kind, the prefill kind, and why."""

    decode: str
    prefill: str
    label: str
    reason: str
    decode_ms: dict[str, float]
    prefill_ms: dict[str, float]
    cached: bool = False
    noise: float = 0.0  # the largest relative spread of the leading kinds' timings
    measured_at: float = 0.0  # time.time() of the full measurement

    def weight_format(self, device: torch.device, file_bytes: int) -> tuple[WeightFormat, torch.dtype | None]:
        """The format to load with, and the wide (prefill) float dtype when two copies are kept.

        Weights that cannot stay 4-bit (other block types) follow the fastest float kinds."""
        decode, prefill = self.decode, self.prefill
        two = file_bytes <= TWO_COPIES_MAX_FILE_BYTES
        if decode.startswith("int4"):
            act = torch.bfloat16 if decode == "int4_bf16" else torch.float32
            float_decode = _best(self.decode_ms, _FLOAT)
            float_prefill = _best(self.prefill_ms, _FLOAT)
            int4_wide = None if prefill.startswith("int4") or not two else _FLOAT[prefill]
            narrow = _FLOAT[float_decode]
            wide = _FLOAT[float_prefill] if two and float_prefill != float_decode else None
            return (WeightFormat(narrow, weights_transposed(device, narrow), wide, True, act, int4_wide),
                    wide)
        narrow = _FLOAT[decode]
        if prefill.startswith("int4") or prefill == decode or not two:
            return WeightFormat(narrow, weights_transposed(device, narrow)), None
        wide = _FLOAT[prefill]
        return WeightFormat(narrow, weights_transposed(device, narrow), wide), wide


def default_policy(why: str) -> Policy:
    """The safe format used until this machine is measured."""
    return Policy(DEFAULT, DEFAULT, DEFAULT, f"{DEFAULT} (default) {why}", {}, {})


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


def cache_key(shapes: ModelShapes) -> str:
    return f"v{CACHE_VERSION} | {cpu_identity()} | torch {torch.__version__} | {shapes.key()}"


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
        policy = Policy(**{**entry, "cached": True})
    except TypeError:
        return None
    numbers = [*policy.decode_ms.values(), *policy.prefill_ms.values(), policy.noise,
               policy.measured_at] if isinstance(policy.decode_ms, dict) and isinstance(
                   policy.prefill_ms, dict) else [None]
    ok = (policy.decode in KINDS and policy.prefill in KINDS and policy.decode in policy.decode_ms
          and policy.prefill in policy.prefill_ms
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


# ---- measuring -----------------------------------------------------------------------------


def _weight(kind: str, n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) * 0.05
    if kind.startswith("int4"):
        act = torch.bfloat16 if kind == "int4_bf16" else torch.float32
        return QuantizedWeight(pack_int4(quantize_synthetic(w), act), n, k, act), False
    dtype = _FLOAT[kind]
    return WeightFormat(dtype, weights_transposed(torch.device("cpu"), dtype)).prepare(w), \
        weights_transposed(torch.device("cpu"), dtype)


Products = list[tuple[Callable[[], object], float]]  # (one product, how many per pass)


def _products(shapes: ModelShapes, kind: str, gen: torch.Generator) -> tuple[Products, Products]:
    """One decode step's products (1 row: layers and head) and one `PREFILL_ROWS`-row chunk's
    (layers only: a prefill computes logits for its last row alone), each with its count."""
    decode, prefill = [], []
    for (n, k), count in shapes.layers.items():
        w, t = _weight(kind, n, k, gen)
        x1, xp = torch.randn(1, k, generator=gen), torch.randn(PREFILL_ROWS, k, generator=gen)
        decode.append((partial(linear, x1, w, t), count))
        if kind in PREFILL_KINDS:
            prefill.append((partial(linear, xp, w, t), count))
    head_n, head_k = shapes.head
    head_rows = min(head_n, _HEAD_ROWS_TIMED)
    w, t = _weight(kind, head_rows, head_k, gen)
    decode.append((partial(linear, torch.randn(1, head_k, generator=gen), w, t), head_n / head_rows))
    return decode, prefill


def _pass_ms(products: Products) -> float:
    total = 0.0
    for fn, count in products:
        start = time.perf_counter()
        fn()
        total += (time.perf_counter() - start) * count
    return total * 1000


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
    """Median milliseconds per kind (decode step, prefill chunk) and each kind's spread."""

    decode_ms: dict[str, float]
    prefill_ms: dict[str, float]
    decode_spread: dict[str, float] = field(default_factory=dict)
    prefill_spread: dict[str, float] = field(default_factory=dict)


def measure(shapes: ModelShapes, kinds=KINDS, reps: int | None = None,
            busy: Callable[[], bool] | None = None) -> Measurement | None:
    """Time `kinds` interleaved: each of `reps` repetitions times every kind once, in an order
    rotated per repetition (a burst of load hits every kind alike); a kind's figure is its
    median. None when `busy()` turns true between timings (the engine got work): such a
    measurement would be disturbed, and the engine must not wait for it.

    One 4-bit plane is timed; a model whose blocks need two planes (Q5/Q8) is charged
    `int4_planes` times that, and its weights that do not fit at all the best float kind's
    time (`_blend`)."""
    gen = torch.Generator().manual_seed(0)
    kinds, reps = list(kinds), REPS if reps is None else reps
    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in kinds}
    with torch.inference_mode():
        products = {kind: _products(shapes, kind, gen) for kind in kinds}
        for decode, prefill in products.values():  # first calls initialise lazily: untimed
            _pass_ms(decode), _pass_ms(prefill)
        for rep in range(reps):
            for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
                if busy is not None and busy():
                    return None
                decode, prefill = products[kind]
                samples[kind][0].append(_pass_ms(decode))
                if prefill:
                    samples[kind][1].append(_pass_ms(prefill))
    med = {k: statistics.median(d) for k, (d, _) in samples.items()}
    med_p = {k: statistics.median(p) for k, (_, p) in samples.items() if p}
    return Measurement(_blend(med, shapes), _blend(med_p, shapes),
                       {k: round(spread(d), 3) for k, (d, _) in samples.items()},
                       {k: round(spread(p), 3) for k, (_, p) in samples.items() if p})


def _blend(times: dict[str, float], shapes: ModelShapes) -> dict[str, float]:
    floats = [times[k] for k in times if k in _FLOAT]
    best_float = min(floats) if floats else 0.0
    out = {}
    for kind, ms in times.items():
        if kind.startswith("int4"):
            fit = shapes.int4_fraction
            ms = fit * ms * shapes.int4_planes + (1 - fit) * best_float
        out[kind] = round(ms, 3)
    return out


# ---- choosing ------------------------------------------------------------------------------


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
    allowed = [k for k in decode_ms if k not in FAILS_QUALITY]
    if shapes.int4_fraction == 0 or not int4_kernel_available():
        allowed = [k for k in allowed if not k.startswith("int4")]
    decode = _pick(decode_ms, allowed, _noise(decode_ms, m.decode_spread, allowed))
    prefill_allowed = [k for k in allowed if k in prefill_ms]
    prefill = _pick(prefill_ms, prefill_allowed, _noise(prefill_ms, m.prefill_spread, prefill_allowed))
    if decode.startswith("int4") and prefill.startswith("int4") and prefill != decode:
        # One set of 4-bit planes, one activation dtype: the prefill goes to a float copy.
        prefill = _pick(prefill_ms, [k for k in prefill_allowed if k in _FLOAT], 0.0)
    noise = max(_noise(decode_ms, m.decode_spread, allowed),
                _noise(prefill_ms, m.prefill_spread, prefill_allowed))
    label = decode if decode == prefill else f"{decode} decode, {prefill} prefill"
    return Policy(decode, prefill, label, _reason(decode_ms, prefill_ms, decode, prefill, allowed,
                                                  shapes, noise),
                  decode_ms, prefill_ms, noise=round(noise, 3), measured_at=time.time())


def _noise(times: dict[str, float], spreads: dict[str, float], allowed: list[str]) -> float:
    """The larger spread of the two fastest allowed kinds and the default: what a difference
    between them must exceed to mean anything."""
    leading = sorted((k for k in allowed if k in times), key=times.__getitem__)[:2] + [DEFAULT]
    return max((spreads.get(k, 0.0) for k in leading), default=0.0)


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


# ---- cached, validated, measured -----------------------------------------------------------


def cached_policy(shapes: ModelShapes, cache_dir: Path) -> Policy | None:
    """The cached policy for this CPU, torch and model, or None."""
    entry = read_cache(cache_dir / CACHE_FILE).get(cache_key(shapes))
    return _policy_from(entry) if isinstance(entry, dict) else None


def _store(shapes: ModelShapes, cache_dir: Path, policy: Policy) -> None:
    path = cache_dir / CACHE_FILE
    entries = read_cache(path)
    entries[cache_key(shapes)] = {k: v for k, v in asdict(policy).items() if k != "cached"}
    try:
        write_cache(path, entries=entries)
    except OSError:
        pass  # a read-only data folder only costs a re-measurement next time


def measure_and_choose(shapes: ModelShapes, cache_dir: Path,
                       busy: Callable[[], bool] | None = None) -> Policy | None:
    """A full measurement and the choice from it, cached when its timings were steady. When
    they were erratic, or the measurement ran past `BUDGET_S` (a machine this busy times
    nothing reliably), the default is returned, saying why, and nothing is cached. None when
    `busy()` interrupted it."""
    started = time.monotonic()
    over = lambda: time.monotonic() - started > BUDGET_S  # noqa: E731
    m = measure(shapes, busy=lambda: (busy is not None and busy()) or over())
    if m is None:
        if busy is not None and busy():
            return None
        return default_policy(f"kept: the measurement ran past {BUDGET_S:.0f} s on a busy machine "
                              "(nothing cached; measured again next load)")
    policy = choose(m, shapes)
    if policy.noise > ERRATIC:
        return default_policy(f"kept: timings too erratic to choose (noise {policy.noise:.0%}; "
                              f"{policy.reason}; nothing cached, measured again next load)")
    _store(shapes, cache_dir, policy)
    return policy


HOLDS, CHANGED, UNCLEAR, INTERRUPTED = "holds", "changed", "unclear", "interrupted"


def validate(policy: Policy, shapes: ModelShapes, busy: Callable[[], bool] | None = None) -> str:
    """Whether a cached choice still holds: CHANGED when the entry is older than
    `MAX_AGE_DAYS` or when the chosen kind and its runner-up, re-timed for `VALIDATE_REPS`
    repetitions, swapped places beyond noise; UNCLEAR when the re-timing was erratic (the
    steady earlier measurement is kept); INTERRUPTED when `busy()` stopped it."""
    if time.time() - policy.measured_at > MAX_AGE_DAYS * 86_400:
        return CHANGED
    allowed = [k for k in KINDS if k not in FAILS_QUALITY]
    if shapes.int4_fraction == 0 or not int4_kernel_available():
        allowed = [k for k in allowed if not k.startswith("int4")]
    kinds = set()
    for times, chosen in ((policy.decode_ms, policy.decode), (policy.prefill_ms, policy.prefill)):
        others = sorted((k for k in times if k in allowed and k != chosen), key=times.__getitem__)
        kinds |= {chosen, *others[:1]}
    m = measure(shapes, [k for k in KINDS if k in kinds], reps=VALIDATE_REPS, busy=busy)
    if m is None:
        return INTERRUPTED
    return {True: HOLDS, False: CHANGED, None: UNCLEAR}[still_holds(policy, m)]


def still_holds(policy: Policy, m: Measurement) -> bool | None:
    """Whether a re-timing `m` keeps the policy's choices ahead of the other kinds it timed
    (or behind by no more than the noise); None when its timings are erratic."""
    spreads = [*m.decode_spread.values(), *m.prefill_spread.values()]
    if spreads and max(spreads) > ERRATIC:
        return None
    for times, spreads_, chosen in ((m.decode_ms, m.decode_spread, policy.decode),
                                    (m.prefill_ms, m.prefill_spread, policy.prefill)):
        if chosen not in times:
            continue
        rivals = [k for k in times if k != chosen
                  # an int4 decode leaves the prefill to a float copy (one set of planes)
                  and not (times is m.prefill_ms and policy.decode.startswith("int4")
                           and k.startswith("int4"))]
        margin = max([MIN_GAIN, *(spreads_.get(k, 0.0) for k in times)])
        if any(times[k] < times[chosen] * (1 - margin) for k in rivals):
            return False
    return True


def tune(shapes: ModelShapes, cache_dir: Path, busy: Callable[[], bool] | None = None
         ) -> Policy | None:
    """What the background tuner runs after a load: the cached policy if it validates, else
    a fresh measurement (cached when steady). None when it was interrupted or could not tell;
    the caller tries again later."""
    cached = cached_policy(shapes, cache_dir)
    if cached is not None:
        verdict = validate(cached, shapes, busy)
        if verdict == INTERRUPTED:
            return None
        if verdict in (HOLDS, UNCLEAR):
            cached.reason += (" (cached, checked)" if verdict == HOLDS
                              else " (cached; re-check inconclusive, timings erratic)")
            return cached
    return measure_and_choose(shapes, cache_dir, busy)


def policy_for(shapes: ModelShapes, cache_dir: Path) -> Policy:
    """The cached policy for this CPU, torch and model, or a fresh measurement (cached when
    steady): what a command-line load uses before it loads."""
    cached = cached_policy(shapes, cache_dir)
    if cached is not None:
        return cached
    policy = measure_and_choose(shapes, cache_dir)
    assert policy is not None  # nothing can interrupt it
    return policy


# ---- a model file's shapes -----------------------------------------------------------------


def shapes_for(path: Path, cache_dir: Path) -> ModelShapes | None:
    """`gguf_shapes`, remembered per file (path, size, modification time) in the cache, so a
    warm load parses the file's header once (in the loader), not twice."""
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
    if isinstance(known, dict):
        try:
            return ModelShapes(known["name"], {tuple(map(int, k.split("x"))): int(v)
                                               for k, v in known["layers"].items()},
                               tuple(known["head"]), float(known["int4_fraction"]),
                               float(known["int4_planes"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    shapes = gguf_shapes(path)
    if shapes is not None:
        files = _read_section(cache, "files")
        files[key] = {"name": shapes.name, "layers": {f"{n}x{k}": c for (n, k), c in shapes.layers.items()},
                      "head": list(shapes.head), "int4_fraction": shapes.int4_fraction,
                      "int4_planes": shapes.int4_planes}
        try:
            write_cache(cache, files=files)
        except OSError:
            pass
    return shapes



def gguf_shapes(path: Path) -> ModelShapes | None:
    """The linear shapes of a GGUF file's decoder, or None when it is not a GGUF file."""
    from app.models.gguf_file import GGUFFile

    if path.is_dir():
        return None
    layers: dict[tuple[int, int], int] = {}
    head = None
    fit, total, planes = 0, 0, 0
    with GGUFFile(path) as gguf:
        name = gguf.get("general.name") if isinstance(gguf.get("general.name"), str) else path.stem
        for tensor, info in gguf.tensors.items():
            if len(info.shape) != 2:
                continue
            n, k = (int(d) for d in info.shape)
            if tensor in ("token_embd.weight", "output.weight"):
                if head is None or tensor == "output.weight":
                    head = (n, k)
                if tensor == "token_embd.weight" and "output.weight" in gguf.tensors:
                    continue  # an untied embedding is only gathered from
            elif tensor.startswith("blk.0."):
                layers[(n, k)] = layers.get((n, k), 0) + 1
            total += n * k
            fit += n * k if info.ggml_type in INT4_TYPES else 0
            planes += n * k * (1 if info.ggml_type in ONE_PLANE_TYPES else 2) if info.ggml_type in INT4_TYPES else 0
        n_layers = sum(1 for t in gguf.tensors if t.endswith(".attn_norm.weight"))
    if head is None or not layers:
        return None
    layers = {shape: count * max(n_layers, 1) for shape, count in layers.items()}
    return ModelShapes(name, layers, head, fit / max(total, 1), planes / max(fit, 1))
