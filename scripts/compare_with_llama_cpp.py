#!/usr/bin/env python3
"""Dev-only: our engine and llama.cpp side by side, in one run, on the same GGUF and prompts.

llama.cpp comes from `llama-cpp-python` (built from source; never a dependency of the app),
installed in a separate virtual environment whose python is passed as --llama-python:

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python
    .venv/bin/python scripts/compare_with_llama_cpp.py --llama-python /tmp/llvenv/bin/python

Both sides decode 128 greedy tokens after the same 33-token prompt and prefill the same
1,024 tokens, each with 2 threads, one after the other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_SIDE = r"""
import json, sys, time
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[4])
decode_ids, prefill_ids = json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = Llama(model_path=path, n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)
def decode(n):
    llm.reset(); llm.eval(decode_ids)
    start = time.perf_counter()
    for _ in range(n):
        token = int(llm._scores[llm.n_tokens - 1].argmax())
        llm.eval([token])
    return n / (time.perf_counter() - start)
def prefill():
    llm.reset(); start = time.perf_counter(); llm.eval(prefill_ids)
    return time.perf_counter() - start
decode(8); prefill()  # warm up
print(json.dumps({"decode_tokens_per_s": round(max(decode(128) for _ in range(2)), 1),
                  "prefill_1024_s": round(min(prefill() for _ in range(2)), 2)}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtypes", default="auto,float16")
    args = parser.parse_args()

    from app.bench import filler_ids, run_dtype_comparison
    from app.cli import resolve_model_path
    from app.models.gguf_file import GGUFFile
    from app.models.tokenizer import Tokenizer

    path = resolve_model_path(args.model, None)
    with GGUFFile(path) as gguf:
        tokenizer = Tokenizer.from_gguf(gguf)

    decode_ids = [tokenizer.bos_id] + filler_ids(tokenizer, 32)
    prefill_ids = [tokenizer.bos_id] + filler_ids(tokenizer, 1023, salt=1)

    ours = run_dtype_comparison(path, "cpu", args.dtypes.split(","))
    llama = json.loads(subprocess.run(
        [args.llama_python, "-c", LLAMA_SIDE, str(path), json.dumps(decode_ids),
         json.dumps(prefill_ids), "2"], check=True, capture_output=True, text=True).stdout)
    print(f"llama.cpp           decode {llama['decode_tokens_per_s']:6.1f} tok/s   "
          f"prefill 1,024 {llama['prefill_1024_s']:5.2f} s")
    for row in ours:
        print(f"ferrox {row['dtype']:<12} decode {row['decode_tokens_per_s']:6.1f} tok/s   "
              f"prefill 1,024 {row['prefill_1024_s']:5.2f} s   "
              f"decode ratio {row['decode_tokens_per_s'] / llama['decode_tokens_per_s']:.2f}x   "
              f"prefill ratio {llama['prefill_1024_s'] / row['prefill_1024_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
