"""Run by test_kv_restore.py in a fresh process: one conversation on the tiny model with the
prefix cache on disk in DIR, printing what the engine reported as JSON and saving the rows
of logits it sampled from in LOGITS_NPY (float32 [tokens, vocabulary]: 262,144 columns with
the built-in Gemma's tokenizer, which as JSON took seconds to write and read).

    python -m tests.engine.kv_restore_child MODEL_GGUF DIR PROMPT_IDS_JSON LOGITS_NPY [--no-store]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from app.engine.engine import Engine, EngineConfig
from app.engine.events import Finished, PrefillProgress, Token
from app.engine.kv_disk import KVDiskStore, StoreIdentity
from app.engine.sampling import SamplingParams
from app.models.gguf_file import GGUFFile
from app.models.tokenizer import tokenizer_from_gguf
from tests.engine.conftest import make_tiny_model


def main() -> None:
    model_path, store_dir, prompt = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    logits_out = sys.argv[4]
    with GGUFFile(model_path) as gguf:
        tokenizer = tokenizer_from_gguf(gguf)
    loaded = make_tiny_model(tokenizer)
    kv = loaded.kv_facts
    store = None
    if "--no-store" not in sys.argv:
        identity = StoreIdentity("tiny-model-seed-0", loaded.weights_label, "float32", 16,
                                 kv.n_layers, kv.n_kv_heads, kv.head_dim)
        store = KVDiskStore(store_dir, identity, 10**9)
    engine = Engine(loaded, EngineConfig(page_size=16, kv_tokens=4096, prefill_chunk=64), store)
    logits = []
    original = engine._sample

    def keep_logits(request, row, events):
        logits.append(row.float().numpy().copy())
        original(request, row, events)

    engine._sample = keep_logits
    engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "r")
    finished, restored_progress = None, 0
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, Finished):
                finished = event
            elif isinstance(event, PrefillProgress):
                restored_progress = max(restored_progress, event.restored)
    engine.close()
    np.save(logits_out, np.stack(logits))
    print(json.dumps({"ids": list(finished.completion_ids), "cached": finished.usage.cached_tokens,
                      "restored": finished.usage.restored_tokens, "progress_restored": restored_progress}))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
