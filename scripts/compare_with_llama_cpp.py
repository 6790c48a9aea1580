#!/usr/bin/env python3
"""Dev-only: our engine and llama.cpp side by side, in one run, on the same GGUF and prompts.

llama.cpp comes from `llama-cpp-python` (built from source; never a dependency of the app),
installed in a separate virtual environment whose python is passed as --llama-python:

    python3 -m venv /work/llama-venv && /work/llama-venv/bin/pip install llama-cpp-python
    .venv/bin/python scripts/compare_with_llama_cpp.py --llama-python /work/llama-venv/bin/python

For each model (default: both built-in models, Gemma 3 270M Q4_K_M and SmolLM2 135M Q4_1,
taken from the app's models folder), both sides load the file, decode 128 greedy tokens
after the same prompt (BOS where the model wants it, then 32 tokens of prose), prefill the
same 1,023-1,024 tokens (likewise: the ids `bench` uses) and decode 128 tokens again after a
prompt of --long-context tokens (4,000; 0 skips it: a long chat's pace), with the same
thread count, one after the other; every configuration runs in its own process so its peak
memory (resident set) is its own. Ratios above 1.0 mean we are faster. llama.cpp runs with
flash attention on (its own default) and off (llama-cpp-python's), and each of its figures
is the better of the two. The CPU capability torch reports is printed first: the figures
only mean something with it. An `auto` row says what the measured CPU policy chose, why, and
whether that choice was measured or its cached entry checked in this run ("policy measured
now", "policy cached, checked now", ...). Without --llama-python (or if it cannot import
llama_cpp) only our side runs.

An AVX-512 machine can stand in for an AVX2-only CPU (the class issue 9 was filed on; its
caches and memory stay this machine's): llama.cpp built without AVX-512 in a venv of its own,

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \
        /work/llama-avx2/bin/pip install --no-cache-dir --no-binary llama-cpp-python llama-cpp-python

and our side on torch's AVX2 kernels, with oneDNN and MKL held to AVX2 as well:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python scripts/compare_with_llama_cpp.py --llama-python /work/llama-avx2/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Short names for the built-in models (app.models.embedded.BUILTIN_MODELS keys work too).
BUILTIN = {"gemma": "gemma-3-270m", "smollm2": "smollm2-135m-instruct"}

LLAMA_SIDE = r"""
import json, resource, sys, time
import numpy as np
from llama_cpp import Llama
path, threads, n_decode = sys.argv[1], int(sys.argv[4]), int(sys.argv[5])
decode_ids, prefill_ids = json.loads(sys.argv[2]), json.loads(sys.argv[3])
long_ids = json.loads(sys.argv[6])
# llama.cpp's own default ("auto") runs flash attention on the CPU; llama-cpp-python turns it
# off unless asked. Neither is faster everywhere (SmolLM2 on a 2-core AVX-512 Xeon: ~107 against
# ~94 tok/s decode with it, 34 against 42 tok/s after 4,000 prompt tokens without), so each
# figure is llama.cpp's better of the two, and says which.
best, which, load_s = {}, {}, None
def better(key, value, setting, lower=False):
    if value is not None and (key not in best or (value < best[key] if lower else value > best[key])):
        best[key], which[key] = value, setting
for flash in (True, False):
    start = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=max(4096, len(long_ids) + n_decode + 16), n_threads=threads,
                n_threads_batch=threads, n_batch=512, flash_attn=flash, verbose=False)
    load_s = load_s if load_s is not None else time.perf_counter() - start
    def last_logits():
        # The context's logits of the last token evaluated (llama-cpp-python keeps no copy of
        # them without logits_all: its `scores` rows stay unwritten).
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    def decode(n, ids=decode_ids):
        llm.reset(); llm.eval(ids)
        start = time.perf_counter()
        for _ in range(n):
            token = int(last_logits().argmax())  # greedy, as our side
            llm.eval([token])
        return n / (time.perf_counter() - start)
    def prefill():
        llm.reset(); start = time.perf_counter(); llm.eval(prefill_ids)
        return time.perf_counter() - start
    prefill()  # warm up
    setting = "on" if flash else "off"
    if n_decode:
        better("decode_tokens_per_s", round(max(decode(n_decode) for _ in range(2)), 1), setting)
        if long_ids:
            better("decode_long_tokens_per_s", round(max(decode(n_decode, long_ids) for _ in range(2)), 1),
                   setting)
    better("prefill_1024_s", round(min(prefill() for _ in range(2)), 2), setting, lower=True)
    if hasattr(llm, "close"):
        llm.close()
    del llm
stream_ids = json.loads(sys.argv[7])
streams = {}
if stream_ids and n_decode:
    # Several sequences decoding together, through llama.cpp's own batch API (the high-level
    # `Llama` holds one sequence): one context with a sequence slot per stream, every step a
    # batch of one token per stream, each stream's greedy token read from its own row.
    import llama_cpp as L
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, len(stream_ids))
    def put(i, token, pos, seq, logits):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
    def greedy(ctx, row):
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(vocab,)).argmax())
    def rate(ctx, prompts, steps=96):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        i, lasts = 0, []
        for seq, ids in enumerate(prompts):  # every prompt read in one batch
            for p, token in enumerate(ids):
                put(i, token, p, seq, p == len(ids) - 1)
                i += 1
            lasts.append(i - 1)
        batch.n_tokens = i
        assert L.llama_decode(ctx, batch) == 0
        nxt, pos = [greedy(ctx, row) for row in lasts], [len(ids) for ids in prompts]
        start = time.perf_counter()
        for _ in range(steps):
            for seq in range(len(prompts)):
                put(seq, nxt[seq], pos[seq], seq, True)
            batch.n_tokens = len(prompts)
            assert L.llama_decode(ctx, batch) == 0
            for seq in range(len(prompts)):
                nxt[seq] = greedy(ctx, seq)
                pos[seq] += 1
        return len(prompts) * steps / (time.perf_counter() - start)
    for flash in (L.LLAMA_FLASH_ATTN_TYPE_ENABLED, L.LLAMA_FLASH_ATTN_TYPE_DISABLED):
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = len(stream_ids), threads, threads
        params.flash_attn_type = flash
        if hasattr(params, "kv_unified"):
            params.kv_unified = True
        ctx = L.llama_init_from_model(model, params)
        rates = {1: 0.0, len(stream_ids): 0.0}
        for n in (1, len(stream_ids)) * 2:
            rates[n] = max(rates[n], rate(ctx, stream_ids[:n]))
        L.llama_free(ctx)
        if rates[len(stream_ids)] > streams.get("streams_n_tokens_per_s", 0.0):
            streams = {"streams_1_tokens_per_s": round(rates[1], 1),
                       "streams_n_tokens_per_s": round(rates[len(stream_ids)], 1)}
            which["streams"] = "on" if flash == L.LLAMA_FLASH_ATTN_TYPE_ENABLED else "off"
print(json.dumps({"decode_tokens_per_s": best.get("decode_tokens_per_s"),
                  "prefill_1024_s": best["prefill_1024_s"],
                  "decode_long_tokens_per_s": best.get("decode_long_tokens_per_s"),
                  **streams,
                  "flash_attention": which,
                  "load_s": round(load_s, 2),
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
"""

OUR_SIDE = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
import torch
from app.bench import run_dtype_comparison
from app.engine.device import configure_cpu_threads
configure_cpu_threads()
row = run_dtype_comparison(sys.argv[1], "cpu", [sys.argv[2]], decode_tokens=int(sys.argv[4]),
                           long_context=int(sys.argv[5]), streams=int(sys.argv[6]))[0]
print(json.dumps(row))
"""


def prompts(path: Path, long_context: int, streams: int
            ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """The token ids `app.bench.run_dtype_comparison` feeds our side, for llama.cpp's side:
    the decode prompt, the prefill prompt, the long prompt (empty without `long_context`) and
    the streams' prompts (none without `streams`)."""
    from app.bench import filler_ids, stream_prompts
    from app.models.loader import load_tokenizer
    from app.models.prompt import bos_prefix

    tokenizer = load_tokenizer(path)
    bos = bos_prefix(tokenizer)
    long = bos + filler_ids(tokenizer, long_context, salt=2) if long_context else []
    together = stream_prompts(tokenizer, 24, streams) if streams > 1 else []
    return bos + filler_ids(tokenizer, 32), bos + filler_ids(tokenizer, 1023, salt=1), long, together


def model_path(spec: str) -> Path:
    """A built-in model (short name or key; put in the models folder if needed) or a path."""
    from app.cli import resolve_model_path
    from app.models.embedded import BUILTIN_MODELS, ensure_builtin_model
    from app.paths import models_dir

    key = BUILTIN.get(spec, spec)
    if any(m.key == key for m in BUILTIN_MODELS):
        return ensure_builtin_model(key, models_dir(None))
    return resolve_model_path(spec, None)


def run_json(cmd: list[str], env: dict) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": tail}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _streams(row: dict, n: int) -> str:
    """e.g. "4 streams at once 255.7 tok/s, one 122.7: 2.08x"."""
    one, many = row["streams_1_tokens_per_s"], row["streams_n_tokens_per_s"]
    return f"{n} streams at once {many:.1f} tok/s, one {one:.1f}: {many / one:.2f}x"


def _rate(row: dict, key: str = "decode_tokens_per_s") -> str:
    return "     -" if row.get(key) is None else f"{row[key]:6.1f}"


def llama_usable(python: str | None) -> bool:
    if not python:
        return False
    try:
        return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main() -> int:
    import os

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", default="/work/llama-venv/bin/python")
    parser.add_argument("--models", default="gemma,smollm2",
                        help="comma-separated: gemma (Gemma 3 270M), smollm2 (SmolLM2 135M), "
                             "default (the default chat model), or GGUF paths")
    parser.add_argument("--dtypes", default="auto,float16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="greedy tokens timed for decode; 0: prefill only (a busy machine)")
    parser.add_argument("--long-context", type=int, default=4000,
                        help="prompt tokens before the long-chat decode; 0 skips it")
    parser.add_argument("--streams", type=int, default=4,
                        help="streams decoding at once, against one (24-token prompts); "
                             "0 skips it")
    args = parser.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    print(f"CPU capability (torch): {torch.backends.cpu.get_cpu_capability()}; threads {args.threads}; "
          f"torch {torch.__version__}")
    with_llama = llama_usable(args.llama_python)
    if not with_llama:
        print(f"llama.cpp: {args.llama_python} cannot import llama_cpp; our side only")
    for spec in args.models.split(","):
        path = model_path(spec)
        print(f"\n== {path.name}")
        try:
            decode_ids, prefill_ids, long_ids, stream_ids = prompts(path, args.long_context,
                                                                   args.streams)
        except Exception as exc:  # the model's tokenizer may not be readable by the app yet
            print(f"   skipped: {exc}")
            continue
        llama = None
        if with_llama:
            llama = run_json([args.llama_python, "-c", LLAMA_SIDE, str(path), json.dumps(decode_ids),
                              json.dumps(prefill_ids), str(args.threads), str(args.decode_tokens),
                              json.dumps(long_ids), json.dumps(stream_ids)], env)
            if "error" in llama:
                print(f"   llama.cpp failed: {llama['error']}")
                llama = None
            else:
                print(f"   llama.cpp           decode {_rate(llama)} tok/s   "
                      f"prefill 1,024 {llama['prefill_1024_s']:5.2f} s   "
                      f"after {args.long_context:,} {_rate(llama, 'decode_long_tokens_per_s')} tok/s   "
                      f"peak {llama['peak_rss_mb']} MB   load {llama['load_s']:.2f} s")
                flash = llama.get("flash_attention", {})
                print("      llama.cpp's better of flash attention on and off: "
                      + ", ".join(f"{name} {flash[key]}" for key, name in (
                          ("decode_tokens_per_s", "decode"), ("prefill_1024_s", "prefill"),
                          ("decode_long_tokens_per_s", "long-chat decode"), ("streams", "streams"))
                          if key in flash))
                if llama.get("streams_n_tokens_per_s"):
                    print(f"      llama.cpp {_streams(llama, args.streams)}")
        for dtype in args.dtypes.split(","):
            row = run_json([sys.executable, "-c", OUR_SIDE, str(path), dtype, str(ROOT),
                            str(args.decode_tokens), str(args.long_context), str(args.streams)], env)
            if "error" in row:
                print(f"   ferrox {dtype:<12} failed: {row['error']}")
                continue
            line = (f"   ferrox {dtype:<12} decode {_rate(row)} tok/s   "
                    f"prefill 1,024 {row['prefill_1024_s']:5.2f} s   "
                    f"after {args.long_context:,} {_rate(row, 'decode_long_tokens_per_s')} tok/s   "
                    f"peak {row['peak_rss_mb']} MB   load {row['load_s']:.2f} s")
            if row.get("running_peak_rss_mb"):
                line += f"   peak after loading {row['running_peak_rss_mb']} MB"
            if llama:
                if row["decode_tokens_per_s"] and llama["decode_tokens_per_s"]:
                    line += f"   decode ratio {row['decode_tokens_per_s'] / llama['decode_tokens_per_s']:.2f}x"
                line += (f"   prefill ratio {llama['prefill_1024_s'] / row['prefill_1024_s']:.2f}x")
                if row.get("decode_long_tokens_per_s") and llama.get("decode_long_tokens_per_s"):
                    line += (f"   long-chat decode ratio "
                             f"{row['decode_long_tokens_per_s'] / llama['decode_long_tokens_per_s']:.2f}x")
            print(line)
            if row.get("streams_n_tokens_per_s"):
                together = f"      ours {_streams(row, args.streams)}"
                if llama and llama.get("streams_n_tokens_per_s"):
                    together += (f"; at {args.streams} streams ours / llama.cpp's "
                                 f"{row['streams_n_tokens_per_s'] / llama['streams_n_tokens_per_s']:.2f}x")
                print(together)
            status = f"policy {row['policy_status']}; " if row.get("policy_status") else ""
            print(f"      weights {row['weights']}; {status}{row['why']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
