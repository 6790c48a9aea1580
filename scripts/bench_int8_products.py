"""The 8-bit activation kernel (app/models/int8_products.py) against torch's 4-bit kernel,
product by product, at the built-in models' shapes: microseconds a product, one and four
rows, medians, both timed in turn in one process.

    .venv/bin/python scripts/bench_int8_products.py
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python scripts/bench_int8_products.py   # torch's AVX2 kernels

Weights are random codes in each model's formats (SmolLM2 Q4_1; Gemma 3 270M's Q5_0 Q, K, V,
gate and up, Q6_K down, and its 262,144-row screened head). The head is larger than any
cache, as every weight of a decode step is (it streams from memory); the layers' weights
stay in the cache here, so their figures are the kernels' arithmetic.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.models import int8_products  # noqa: E402
from app.models import quantized as Q  # noqa: E402
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

# name: (outputs, inputs, the GGUF type whose layout is timed)
SHAPES = {
    "SmolLM2 qkv": (960, 576, T.Q4_1),
    "SmolLM2 o": (576, 576, T.Q4_1),
    "SmolLM2 gate_up": (3072, 576, T.Q4_1),
    "SmolLM2 down": (576, 1536, T.Q4_1),
    "Gemma qkv": (1536, 640, T.Q5_0),
    "Gemma o": (640, 1024, T.Q4_K),
    "Gemma gate_up": (4096, 640, T.Q5_0),
    "Gemma down": (640, 2048, T.Q6_K),
    "Gemma head screen": (262144, 640, T.Q4_1),
}


def median_us(fn, runs: int) -> float:
    for _ in range(max(3, runs // 10)):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6


def weights(n: int, k: int, t, gen: torch.Generator):
    """(torch's codes, ours) for a random [n, k] weight in `t`'s layout."""
    w = torch.randn(n, k, generator=gen) * 0.05
    form = Q.quantize_int4(w)
    if t == T.Q5_0:
        form = Q.Int4Form(form.lo, torch.randint(0, 2, (n, k), generator=gen, dtype=torch.int8),
                          form.s, form.b)
    if t == T.Q6_K:
        return Q.residual_planes(w, torch.bfloat16), Q.quantize_int8(w)
    return Q.pack_int4(form, torch.bfloat16), Q.int8_codes(form, t)


def main() -> int:
    kernel = int8_products.kernel()
    if kernel is None:
        print(f"The kernel cannot run here: {int8_products.unavailable_reason()}")
        return 1
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads; kernel {kernel.isa}, "
          f"{'torch OpenMP threads' if kernel.threaded else 'one thread'}")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k, t) in SHAPES.items():
        theirs, ours = weights(n, k, t, gen)
        runs = 20 if n > 100_000 else 300
        cells = []
        for rows in (1, 4):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            a = torch.cat([x] * theirs.planes, -1) if theirs.planes > 1 else x
            t_torch = median_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                a, theirs.packed, Q.INT4_GROUP, theirs.scale_zeros), runs)
            t_ours = median_us(lambda: int8_products.matmul(x, ours), runs)
            cells.append(f"{rows} row{'s' if rows > 1 else ''}: torch {t_torch:8.1f}  ours "
                         f"{t_ours:8.1f}  ({t_torch / t_ours:.2f}x)")
        print(f"{name:18s} {n:>6} x {k:<5} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
