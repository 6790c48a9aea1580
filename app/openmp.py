"""Keeping torch's OpenMP helper threads to the engine's own thread.

torch's CPU kernels run in OpenMP parallel regions. GNU OpenMP (libgomp, which torch's Linux
wheels ship) gives every thread that starts a parallel region a pool of helper threads of
its own, kept for that thread's whole life. When the helpers of all pools outnumber the CPUs,
libgomp stops letting any of them spin between regions (100 spins instead of ~300,000): each
helper sleeps right after a region and is woken through the kernel for the next one, and a
decode step has hundreds of regions. So a model loaded on one thread (the GUI's worker, the
server's main thread) and decoded on another (the engine's) decoded at half its speed:
SmolLM2 135M on a 2-core AVX-512 Xeon took 25-28 ms a step on the engine's thread against
13.7 ms on the thread that had loaded it, and the thread tuner then settled on one thread
(~40 tok/s in the window against ~70 in `bench`). A 16-core machine has 15 helpers a pool.

So torch work off the engine's thread (a load, the engine's warm-up, the policy measurement,
document search's encoder) runs on a thread that ends when the work does
(`run_on_passing_thread`): its pool goes with it, and the engine's helpers keep spinning.
Other OpenMP runtimes (LLVM's libomp on macOS, Windows') manage their helpers otherwise;
there the extra thread costs only its start (~0.1 ms).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_on_passing_thread(fn: Callable[..., T], *args, name: str = "ferrox-torch-work",
                          **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread that ends when it returns; blocks until then and
    returns its result, or raises what it raised (with its traceback)."""
    result: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, raised there
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
