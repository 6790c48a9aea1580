"""Per-token cost of constrained decoding on the embedded model's vocabulary (262k tokens):
llguidance against xgrammar, on the CPU, for the same JSON schema and the same token path.

For each engine: tokenizer set-up, grammar compile, then for every token of a valid reply the
mask computation, the mask applied to a [V] float32 row, and the token consumed. Also times
one decode step of the model itself, so the overhead reads as a share of decode time.
Times are CPU time (thread time for the masks, process time for a decode step), so a busy
machine skews them less than wall time would.

    .venv/bin/python scripts/grammar_overhead.py [--model gemma|default|FILE.gguf]

`gemma` (the default here) is the embedded Gemma 3 270M: its 262k-token vocabulary is the
worst case for a mask.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                      "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
REPLY = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "poetry",
                    "engines"], "address": {"city": "London", "zip": "W1"}})


def token_bytes(tokenizer) -> list[bytes]:
    return [tokenizer._raw_bytes(i) for i in range(tokenizer.vocab_size)]


def time_llguidance(tokenizer, path: list[int], vocab: int) -> dict:
    from app.server.grammar import GrammarFactory

    started = time.perf_counter()
    factory = GrammarFactory(tokenizer, vocab, (tokenizer.eos_id,))
    setup = time.perf_counter() - started
    started = time.perf_counter()
    make = factory.json_schema(SCHEMA)
    process = make()
    compile_s = time.perf_counter() - started
    logits = torch.randn(vocab)
    steps = []
    generated: list[int] = []
    for token in path:
        row = logits.clone()
        t0 = time.thread_time()
        row = process(generated, row)
        steps.append(time.thread_time() - t0)
        assert row[token] != -float("inf"), "the grammar refused the reply's own token"
        generated.append(token)
    return {"setup_s": setup, "compile_s": compile_s, "steps": steps}


def time_xgrammar(tokenizer, path: list[int], vocab: int) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo(token_bytes(tokenizer), vocab_type=xgr.VocabType.RAW,
                             vocab_size=vocab, stop_token_ids=[tokenizer.eos_id])
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - started
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.randn(vocab)
    steps = []
    for token in path:
        row = logits.clone().unsqueeze(0)
        t0 = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(row, bitmask)
        steps.append(time.thread_time() - t0)
        assert row[0, token] != -float("inf"), "the grammar refused the reply's own token"
        assert matcher.accept_token(token)
    return {"setup_s": setup, "compile_s": compile_s, "steps": steps}


def decode_step_s(loaded, n: int = 24) -> float:
    """The median CPU time (all threads) of an engine step that only decodes one token."""
    from app.engine.engine import Engine, EngineConfig
    from app.engine.events import Token
    from app.engine.sampling import SamplingParams

    engine = Engine(loaded, EngineConfig(kv_tokens=4096))
    prompt = loaded.tokenizer.encode("Once upon a time")
    engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    steps, tokens = [], 0
    while engine.has_work:
        started = time.process_time()
        events = engine.step()
        took = time.process_time() - started
        if tokens and any(isinstance(e, Token) for e in events):
            steps.append(took)  # not the first token: that step ran the prefill
        tokens += sum(isinstance(e, Token) for e in events)
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma")
    args = parser.parse_args()
    from app.cli import resolve_model_path
    from app.engine.device import load_on
    from app.models.embedded import ensure_embedded_model
    from app.paths import models_dir

    path = (ensure_embedded_model(models_dir(None)) if args.model == "gemma"
            else resolve_model_path(args.model, None))
    loaded = load_on(path, "cpu", "auto")
    tokenizer = loaded.tokenizer
    path = tokenizer.encode(REPLY) + [tokenizer.eos_id]
    vocab = loaded.vocab_size
    decode = decode_step_s(loaded)
    print(f"CPU: {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"model {loaded.name}: vocab {vocab:,}, decode step {decode * 1e3:.1f} ms "
          f"({len(path)} reply tokens)")
    for name, run in (("llguidance", time_llguidance), ("xgrammar", time_xgrammar)):
        try:
            result = run(tokenizer, path, vocab)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        steps = result["steps"]
        mean, median = statistics.mean(steps), statistics.median(steps)
        print(f"{name:10s} setup {result['setup_s']:.2f} s, compile {result['compile_s'] * 1e3:.0f} ms, "
              f"mask+apply per token: mean {mean * 1e3:.2f} ms, median "
              f"{median * 1e3:.2f} ms, max {max(steps) * 1e3:.2f} ms; mean = {100 * mean / decode:.1f}% "
              f"of a decode step")


if __name__ == "__main__":
    main()
