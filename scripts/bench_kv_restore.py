#!/usr/bin/env python3
"""The prefix cache on disk, measured: the first token of a follow-up in a ~4,000-token
document conversation after a restart, recomputed (cold) against restored from disk; bytes
per token on disk; restore throughput.

A restart is modelled by a fresh engine (empty pool and radix tree) on the same loaded
weights, so the figures compare the two ways of getting the KV back, not model loading.

    python scripts/bench_kv_restore.py [--model FILE] [--device cpu] [--dtype auto] [--tokens 4000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_token_seconds(engine, prompt, params) -> tuple[float, dict]:
    from app.engine.events import Finished, Token

    started = time.perf_counter()
    engine.submit(prompt, params, "r")
    first, finished = None, None
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, Token) and first is None:
                first = time.perf_counter() - started
            elif isinstance(event, Finished):
                finished = event
    return first, {"cached": finished.usage.cached_tokens, "restored": finished.usage.restored_tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args()
    import torch

    from app.bench import filler_ids
    from app.cli import resolve_model_path
    from app.engine.device import load_on
    from app.engine.engine import Engine, EngineConfig
    from app.engine.kv_disk import open_store
    from app.engine.sampling import SamplingParams
    from app.models.prompt import bos_prefix

    loaded = load_on(resolve_model_path(args.model, None), args.device, args.dtype)
    tok = loaded.tokenizer
    config = EngineConfig(kv_tokens=max(8192, 2 * args.tokens))
    store_dir = Path(tempfile.mkdtemp(prefix="ferrox-kv-"))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    conversation = bos_prefix(tok) + filler_ids(tok, args.tokens, salt=7)
    # The first session: the document conversation, saved when the engine goes idle.
    engine = Engine(loaded, config, open_store(store_dir, loaded, config.page_size))
    first_token_seconds(engine, conversation, params)
    engine.close()
    follow_up = conversation + filler_ids(tok, 24, salt=8)
    cold_s, cold = first_token_seconds(Engine(loaded, config), follow_up, params)
    store = open_store(store_dir, loaded, config.page_size)
    started = time.perf_counter()
    warm_s, warm = first_token_seconds(Engine(loaded, config, store), follow_up, params)
    saved = store.size_bytes()
    result = {
        "model": loaded.name, "weights": loaded.weights_label, "device": str(loaded.device),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "conversation_tokens": len(conversation), "follow_up_tokens": len(follow_up),
        "cold_first_token_s": round(cold_s, 3), "restored_first_token_s": round(warm_s, 3),
        "ratio": round(warm_s / cold_s, 3), "restored_tokens": warm["restored"],
        "bytes_on_disk": saved, "bytes_per_token": round(saved / max(warm["restored"], 1)),
        "restore_tokens_per_s": round(warm["restored"] / warm_s),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
