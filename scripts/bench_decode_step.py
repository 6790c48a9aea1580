#!/usr/bin/env python3
"""A decode pass's step (app/models/decode_step.py: TorchScript, or every layer one compiled
call, `app/models/decode_block.py`, on 8-bit activations) against the layers' Python, side by
side in one process: one engine, the two ways taken in turn (alternating which goes first),
one stream and four streams after short prompts, 96 greedy tokens each; prints each way's
median tokens per second and whether both produced the same tokens.

    python scripts/bench_decode_step.py [--model FILE] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default", help="a .gguf file or 'default'")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    import torch

    from app.bench import _decoding_rate, _drive, bos_prefix, filler_ids
    from app.engine.device import configure_cpu_threads, load_on
    from app.engine.engine import Engine, EngineConfig
    from app.cli import resolve_model_path
    from app.engine.sampling import SamplingParams
    from app.models import decode_step

    configure_cpu_threads()
    loaded = load_on(resolve_model_path(args.model, None), "cpu", "auto")
    mode = decode_step.mode(loaded.model)
    if mode not in ("TorchScript", "compiled layers"):
        sys.exit(f"decode steps of this model run in {decode_step.mode(loaded.model)}: nothing to compare")
    engine = Engine(loaded, EngineConfig(kv_tokens=8192))
    tok = loaded.tokenizer
    greedy = dict(temperature=0, ignore_eos=True)

    def streams(n: int) -> tuple[float, dict]:
        engine.clear_cache()
        prompts = {f"s{i}": bos_prefix(tok) + filler_ids(tok, 24, salt=10 + i) for i in range(n)}
        _drive(engine, {k: (ids, SamplingParams(max_tokens=1, **greedy)) for k, ids in prompts.items()})
        traces = _drive(engine, {k: (ids, SamplingParams(max_tokens=96, **greedy))
                                 for k, ids in prompts.items()})
        return _decoding_rate(traces), {k: t.finished.completion_ids for k, t in traces.items()}

    rates = {way: {1: [], 4: []} for way in ("python", "step")}
    tokens = {}
    original = decode_step.run
    try:
        for i in range(args.rounds):
            for way in (("python", "step") if i % 2 else ("step", "python")):
                decode_step.run = original if way == "step" else (lambda *args, **kwargs: None)
                for n in (1, 4):
                    rate, ids = streams(n)
                    rates[way][n].append(rate)
                    tokens.setdefault((way, n), ids)
    finally:
        decode_step.run = original
    result = {"model": loaded.name, "step": mode, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(),
              "same_tokens": all(tokens[("python", n)] == tokens[("step", n)] for n in (1, 4))}
    for way, by_n in rates.items():
        for n, values in by_n.items():
            result[f"{way}_{n}_streams_tokens_per_s"] = round(statistics.median(values), 1)
    for n in (1, 4):
        result[f"speedup_{n}_streams"] = round(result[f"step_{n}_streams_tokens_per_s"]
                                               / result[f"python_{n}_streams_tokens_per_s"], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
