"""Decode and prefill speed while another program keeps CPU cores busy, with and without the
engine's thread tuner (app/engine/thread_tuner.py).

A user's computer is rarely idle: a browser, a build or a second model takes cores. This
starts `--hogs` busy-loop processes (default 1: one core of a 2-core machine), then runs the
default built-in model (or --model) in fresh processes, alternating three ways each
repetition so the figures are side by side:

  all      every thread, fixed (the engine before the tuner)
  tuned    the engine's tuner chooses between all threads and half of them as it runs
  half     half the threads, fixed

    .venv/bin/python scripts/bench_cpu_contention.py                 # 1 hog, 3 repetitions
    .venv/bin/python scripts/bench_cpu_contention.py --hogs 0        # the idle machine
    .venv/bin/python scripts/bench_cpu_contention.py --dtype auto --reps 5

Printed per way: decode tokens per second (300 greedy tokens after a short prompt) and a
512-token prefill's seconds, each the median over the repetitions, with the CPU class and the
load average. Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("all", "tuned", "half")


def child(way: str, model: str, dtype: str) -> None:
    """One measurement in this process: JSON on stdout."""
    sys.path.insert(0, str(ROOT))
    import torch

    from app.bench import _drive, filler_ids
    from app.cli import resolve_model_path
    from app.engine.device import load_on
    from app.engine.engine import Engine, EngineConfig
    from app.engine.sampling import SamplingParams
    from app.models.prompt import bos_prefix

    loaded = load_on(resolve_model_path(model, None), "cpu", dtype, measure=False)
    if way == "half":
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    engine = Engine(loaded, EngineConfig(kv_tokens=4096, tune_threads=way == "tuned"))
    tok = loaded.tokenizer
    greedy = dict(temperature=0, ignore_eos=True)
    decode = _drive(engine, {"d": (bos_prefix(tok) + filler_ids(tok, 23, salt=1),
                                   SamplingParams(max_tokens=300, **greedy))})["d"].finished
    prefill = _drive(engine, {"p": (bos_prefix(tok) + filler_ids(tok, 511, salt=2),
                                    SamplingParams(max_tokens=1, **greedy))})["p"].finished
    print(json.dumps({"decode": decode.timings.decode_tokens_per_s,
                      "prefill_512_s": prefill.timings.prefill_s,
                      "weights": loaded.policy_label or loaded.weights_label,
                      "threads_now": (engine.threads.current if engine.threads.enabled
                                      else torch.get_num_threads()),
                      "switches": engine.threads.switches}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes to start")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.dtype)
        return

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "?"
    print(f"CPU: {cpu}; torch capability {torch.backends.cpu.get_cpu_capability()}; "
          f"{os.cpu_count()} logical CPUs; hogs {args.hogs}; load at start {os.getloadavg()[0]:.1f}")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    try:
        for rep in range(args.reps):
            for way in WAYS:
                out = subprocess.run([sys.executable, __file__, "--child", way, "--model", args.model,
                                      "--dtype", args.dtype], capture_output=True, text=True, cwd=ROOT)
                if out.returncode:
                    sys.exit(f"{way} failed:\n{out.stderr[-2000:]}")
                result = json.loads(out.stdout.strip().splitlines()[-1])
                runs[way].append(result)
                print(f"  rep {rep + 1} {way:<6} decode {result['decode']:6.1f} tok/s   prefill 512 "
                      f"{result['prefill_512_s']:5.2f} s   threads at the end {result['threads_now']}"
                      f" (switches {result['switches']})", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    print(f"load at end {os.getloadavg()[0]:.1f}; weights {runs['all'][0]['weights']}")
    base = statistics.median(r["decode"] for r in runs["all"])
    print(f"{'way':<6} {'decode tok/s':>13} {'vs all':>7} {'prefill 512 s':>14}")
    for way in WAYS:
        decode = statistics.median(r["decode"] for r in runs[way])
        prefill = statistics.median(r["prefill_512_s"] for r in runs[way])
        print(f"{way:<6} {decode:13.1f} {decode / base:6.2f}x {prefill:14.2f}")


if __name__ == "__main__":
    main()
