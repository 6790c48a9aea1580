"""The CPU weight policy, measured on the machine rather than assumed.

CPUs differ more than any fixed rule can follow: on one with AVX-512-BF16/AMX a bfloat16
matrix product is the fastest prefill kernel torch has, on an AVX2-only one it is the
slowest (measured 14.7 s against float16's 3.2 s for a 1,024-token prefill). So on first
load the engine times its candidate kernels on the model's own linear shapes, one row
(decode) and `PREFILL_ROWS` rows (prefill), through the same `linear()` the model runs,
and picks the fastest candidate per product that meets the quality bar. A measurement
takes a second or two; it is cached per CPU (model name and torch's capability), torch
version, thread count and model shapes in `kernel_policy.json` in the data folder, so later
loads only read it. A damaged cache file is ignored and rewritten.

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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from app.models.layers import WeightFormat, linear, weights_transposed
from app.models.quantized import (INT4_TYPES, ONE_PLANE_TYPES, QuantizedWeight, int4_kernel_available, pack_int4,
                                  quantize_synthetic)

CACHE_FILE = "kernel_policy.json"
CACHE_VERSION = 1
PREFILL_ROWS = 128
KINDS = ("float32", "bfloat16", "float16", "int4_bf16", "int4_f32")
# The 4-bit kernel with float32 activations is a decode candidate only: on CPUs measured so
# far its many-row product is 100x slower than any other (no vectorized path).
PREFILL_KINDS = ("float32", "bfloat16", "float16", "int4_bf16")
FAILS_QUALITY: frozenset[str] = frozenset()
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


def _best(times: dict[str, float], among) -> str:
    return min((k for k in times if k in among), key=times.__getitem__)


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
    ok = (policy.decode in KINDS and policy.prefill in KINDS and isinstance(policy.decode_ms, dict)
          and isinstance(policy.prefill_ms, dict) and all(
              isinstance(v, (int, float)) for v in [*policy.decode_ms.values(), *policy.prefill_ms.values()]))
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


def _time(fn: Callable[[], object], reps: int) -> float:
    """Best of `reps` runs, in ms (the best is the least disturbed by other processes)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def measure(shapes: ModelShapes, kinds=KINDS) -> tuple[dict[str, float], dict[str, float]]:
    """Milliseconds per decode step (1 row: layers and head) and per `PREFILL_ROWS`-row
    chunk (layers only: a prefill computes logits for its last row alone), per kind.

    One 4-bit plane is timed; a model whose blocks need two planes (Q5/Q8) is charged
    `int4_planes` times that, and its weights that do not fit at all the best float kind's
    time (`_blend`)."""
    gen = torch.Generator().manual_seed(0)
    decode, prefill = {}, {}
    head_n, head_k = shapes.head
    head_rows = min(head_n, _HEAD_ROWS_TIMED)
    with torch.inference_mode():
        one = torch.randn(1, head_k, generator=gen)
        for kind in kinds:
            total_decode, total_prefill = 0.0, 0.0
            for (n, k), count in shapes.layers.items():
                w, t = _weight(kind, n, k, gen)
                x1, xp = torch.randn(1, k, generator=gen), torch.randn(PREFILL_ROWS, k, generator=gen)
                total_decode += count * _time(lambda: linear(x1, w, t), 3)
                if kind in PREFILL_KINDS:
                    total_prefill += count * _time(lambda: linear(xp, w, t), 1)
            w, t = _weight(kind, head_rows, head_k, gen)
            total_decode += _time(lambda: linear(one, w, t), 2) * head_n / head_rows
            decode[kind] = total_decode
            if kind in PREFILL_KINDS:
                prefill[kind] = total_prefill
    return _blend(decode, shapes), _blend(prefill, shapes)


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


def choose(decode_ms: dict[str, float], prefill_ms: dict[str, float], shapes: ModelShapes) -> Policy:
    """The fastest kind that meets the quality bar, for decode and for prefill."""
    allowed = [k for k in decode_ms if k not in FAILS_QUALITY]
    if shapes.int4_fraction == 0 or not int4_kernel_available():
        allowed = [k for k in allowed if not k.startswith("int4")]
    decode = min(allowed, key=decode_ms.__getitem__)
    prefill = min((k for k in allowed if k in prefill_ms), key=prefill_ms.__getitem__)
    if decode.startswith("int4") and prefill.startswith("int4") and prefill != decode:
        prefill = decode  # one set of 4-bit planes, one activation dtype
    label = decode if decode == prefill else f"{decode} decode, {prefill} prefill"
    runner_up = min((k for k in allowed if k != decode), key=decode_ms.__getitem__, default=None)
    reason = (f"measured on {cpu_identity()}: decode step {decode_ms[decode]:.1f} ms with {decode}"
              + (f" ({runner_up} {decode_ms[runner_up]:.1f} ms)" if runner_up else "")
              + f"; {PREFILL_ROWS}-row prefill {prefill_ms[prefill]:.1f} ms with {prefill}")
    if decode.startswith("int4") and shapes.int4_fraction < 1:
        reason += f"; {shapes.int4_fraction:.0%} of the weights fit the 4-bit kernel"
    return Policy(decode, prefill, label, reason, decode_ms, prefill_ms)


def policy_for(shapes: ModelShapes, cache_dir: Path) -> Policy:
    """The cached policy for this CPU, torch and model, or a fresh measurement (then cached)."""
    path = cache_dir / CACHE_FILE
    entries = read_cache(path)
    key = cache_key(shapes)
    cached = _policy_from(entries.get(key)) if isinstance(entries.get(key), dict) else None
    if cached is not None:
        return cached
    decode_ms, prefill_ms = measure(shapes)
    policy = choose(decode_ms, prefill_ms, shapes)
    entries[key] = {k: v for k, v in asdict(policy).items() if k != "cached"}
    try:
        write_cache(path, entries=entries)
    except OSError:
        pass  # a read-only data folder only costs a re-measurement next time
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
