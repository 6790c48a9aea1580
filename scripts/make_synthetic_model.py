#!/usr/bin/env python3
"""Dev-only: a Llama-shaped GGUF of random 4-bit (Q4_1) weights, at the shape of a larger
model than the built-in ones, with a built-in model's tokenizer, for measuring the engine
where a decode step is bound by reading the weights rather than by multiplying them.

The built-in models' 4-bit weights (~70 and ~170 MB) stay in a large CPU cache, so their
decode steps are bound by the kernels' arithmetic and every extra row of a batched step
costs nearly what the first did. A model several times a cache's size is read from memory
once a step whatever its rows, which is where most users' machines run their models. The
text this file writes is noise (its weights are random), its timings are a real model's of
that shape: `app bench --model <file>` and `scripts/compare_with_llama_cpp.py --models
<file>` take it as they take any GGUF.

    python scripts/make_synthetic_model.py --shape 1b --out /tmp/synthetic-1b.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# d_model, layers, MLP width, query heads, KV heads (head size 64 throughout).
SHAPES = {
    "1b": (2048, 22, 5632, 32, 4),   # TinyLlama 1.1B's shape: ~0.67 GB as Q4_1
    "3b": (3072, 28, 8192, 48, 8),   # Llama 3.2 3B's width and depth: ~1.9 GB as Q4_1
}
HEAD_SIZE = 64
Q4_1_BLOCK = 32  # values a block: float16 scale and minimum, then 16 bytes of 4-bit codes
Q4_1_BYTES = 20


def q4_1_rows(rng: np.random.Generator, rows: int, cols: int, spread: float) -> np.ndarray:
    """Raw Q4_1 blocks uint8 [rows, cols / 32 * 20] of values uniform in +-spread / 2:
    random codes under one scale and minimum."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_1_BLOCK, Q4_1_BYTES), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(spread / 15).tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(-spread / 2).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def synthetic_tensors(shape: tuple[int, int, int, int, int], vocab: int, seed: int = 0) -> dict:
    """The tensors of a Llama-shaped model with a tied head, in `write_gguf`'s form. Spreads
    of about 1.7 / sqrt(fan-in) keep activations of the order of one through every layer;
    the embedding's 8 / sqrt(d) gives logits a spread of ~2.3, so each token has a clear
    favourite, as a trained model's have."""
    from gguf.constants import GGMLQuantizationType

    d, layers, ffn, heads, kv_heads = shape
    rng = np.random.default_rng(seed)
    q4_1 = GGMLQuantizationType.Q4_1

    def weight(rows: int, cols: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        return q4_1_rows(rng, rows, cols, 1.7 / np.sqrt(cols)), q4_1

    tensors = {"token_embd.weight": (q4_1_rows(rng, vocab, d, 8 / np.sqrt(d)), q4_1),
               "output_norm.weight": np.ones(d, np.float32)}
    for i in range(layers):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": np.ones(d, np.float32),
            p + "ffn_norm.weight": np.ones(d, np.float32),
            p + "attn_q.weight": weight(heads * HEAD_SIZE, d),
            p + "attn_k.weight": weight(kv_heads * HEAD_SIZE, d),
            p + "attn_v.weight": weight(kv_heads * HEAD_SIZE, d),
            p + "attn_output.weight": weight(d, heads * HEAD_SIZE),
            p + "ffn_gate.weight": weight(ffn, d),
            p + "ffn_up.weight": weight(ffn, d),
            p + "ffn_down.weight": weight(d, ffn),
        })
    return tensors


def make_synthetic_model(like: Path, out: Path, shape: tuple[int, int, int, int, int]) -> Path:
    """Write `out`: `like`'s tokenizer and settings (a Llama-architecture GGUF), `shape`'s
    random weights."""
    from app.models.gguf_file import GGUFFile
    from tests.gguf_factory import write_gguf

    with GGUFFile(like) as source:
        arch = source.architecture
        if arch != "llama":
            raise SystemExit(f"{like} is a {arch} model; the tokenizer must come from a Llama-architecture file.")
        metadata = {k: v for k, v in source.metadata.items()
                    if k not in ("general.architecture", "general.alignment")}
    vocab = len(metadata["tokenizer.ggml.tokens"])
    d, layers, ffn, heads, kv_heads = shape
    if d != heads * HEAD_SIZE:
        raise ValueError(f"{heads} heads of {HEAD_SIZE} make a width of {heads * HEAD_SIZE}, not {d}")
    metadata.pop("llama.rope.dimension_count", None)  # the whole head, as d / heads gives it
    metadata.update({"llama.embedding_length": d, "llama.block_count": layers,
                     "llama.feed_forward_length": ffn, "llama.attention.head_count": heads,
                     "llama.attention.head_count_kv": kv_heads,
                     "general.name": f"synthetic {d}x{layers} (random weights)"})
    return write_gguf(out, arch=arch, metadata=metadata, tensors=synthetic_tensors(shape, vocab))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--like", help="a Llama-architecture GGUF whose tokenizer to copy "
                                       "(default: the built-in SmolLM2)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.like:
        like = Path(args.like)
    else:
        from app.models.embedded import ensure_builtin_model
        from app.paths import models_dir
        like = ensure_builtin_model("smollm2-135m-instruct", models_dir(None))
    path = make_synthetic_model(like, Path(args.out), SHAPES[args.shape])
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
