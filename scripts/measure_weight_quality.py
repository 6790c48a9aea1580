#!/usr/bin/env python3
"""Dev-only: how much each weight format costs in quality, against the float32 model.

For each format: the mean negative log-likelihood of a public long text (CPython's LICENSE,
which ships with every Python; its first --tokens tokens), the relative change against
float32, and whether greedy decoding from the reference prompts (tests/fixtures/*.json and,
when given, the shared Gemma reference) gives the same tokens as float32.

A mean NLL can move either way by chance (a format can score below float32), so each format
is also compared with the first one directly, position by position over the same text: the
mean KL divergence from the first's next-token distribution (over the first's top
`KL_TOP` tokens, which hold nearly all of its mass) and how often both take the same
greedy token. Those two shrink as a format gets closer; the NLL need not.

The text is scored in passes of --chunk tokens (default 8), as decoding runs its products:
a 4-bit load multiplies passes of more rows by its float copy (prefill), so longer passes
would measure that copy, not the 4-bit planes every generated token goes through.

    .venv/bin/python scripts/measure_weight_quality.py --model default --formats float32,int4,auto
    .venv/bin/python scripts/measure_weight_quality.py --formats float32,auto --kv float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def license_text() -> str:
    for base in (sysconfig.get_paths()["stdlib"], str(Path(sys.base_prefix) / "lib")):
        for path in Path(base).glob("**/LICENSE.txt"):
            return path.read_text(encoding="utf-8")
    raise SystemExit("CPython's LICENSE.txt was not found next to the standard library.")


KL_TOP = 64  # the reference's most likely tokens a position's KL divergence is summed over


@torch.inference_mode()
def score(loaded, ids: list[int], chunk: int = 8, reference: dict | None = None) -> dict:
    """The text's mean NLL ("nll") and each position's top `KL_TOP` log-probabilities
    ("top_ids", "top_logprobs", [P, KL_TOP], best first: column 0 is the greedy token);
    against a `reference` (the first format's score) also the mean KL divergence from it
    ("kl") and the share of positions taking its greedy token ("argmax_same")."""
    from app.engine.contiguous_kv import ContiguousKV

    kv = ContiguousKV(loaded.kv_facts, len(ids), loaded.device, loaded.kv_dtype)
    total, count, kl = 0.0, 0, 0.0
    top_ids, top_logprobs = [], []
    while kv.length < len(ids) - 1:
        start = kv.length
        part = ids[start: start + chunk]
        hidden = loaded.model(torch.tensor([part]), kv.positions(len(part)), kv)
        kv.commit(len(part))
        targets = torch.tensor(ids[start + 1: start + 1 + len(part)])
        logprobs = torch.log_softmax(loaded.model.logits(hidden[0, : len(targets)]).float(), -1)
        total += torch.nn.functional.nll_loss(logprobs, targets, reduction="sum").item()
        if reference is not None:  # KL(reference || this) over the reference's top tokens
            rows = slice(count, count + len(targets))
            ref_ids, ref_lp = reference["top_ids"][rows], reference["top_logprobs"][rows]
            kl += (ref_lp.exp() * (ref_lp - logprobs.gather(-1, ref_ids))).sum().item()
        values, indices = logprobs.topk(KL_TOP, dim=-1)
        top_ids.append(indices), top_logprobs.append(values)
        count += len(targets)
    out = {"nll": total / count, "top_ids": torch.cat(top_ids), "top_logprobs": torch.cat(top_logprobs)}
    if reference is not None:
        out["kl"] = kl / count
        same = out["top_ids"][:, 0] == reference["top_ids"][:, 0]
        out["argmax_same"] = same.float().mean().item()
    return out


@torch.inference_mode()
def greedy(loaded, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, one model step at a time (no engine, no stop tokens)."""
    from app.engine.contiguous_kv import ContiguousKV

    kv = ContiguousKV(loaded.kv_facts, len(prompt) + n, loaded.device, loaded.kv_dtype)
    out, step = [], prompt
    for _ in range(n):
        hidden = loaded.model(torch.tensor([step]), kv.positions(len(step)), kv)
        kv.commit(len(step))
        token = int(loaded.model.logits(hidden[0, -1:]).argmax())
        out.append(token)
        step = [token]
    return out


def reference_prompts(model_name: str, shared: Path | None) -> list[list[int]]:
    prompts = []
    names = ["smollm2_reference.json"] if "smol" in model_name.lower() else ["gemma3_long_prompt.json"]
    files = [FIXTURES / n for n in names]
    if shared is not None and "smol" not in model_name.lower():
        files.append(shared / "reference" / "gemma3-270m-reference.json")
    for path in files:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if "prompt_ids" in data:
            prompts.append(data["prompt_ids"])
        for case in data.get("cases", []):
            prompts.append(case["prompt_ids"])
    return prompts


def requantized_copy(path: Path, qtype_name: str, folder: Path) -> Path:
    """A copy of a GGUF model whose 2-D weights are re-quantized to `qtype_name` (from their
    float32 dequantization; norms and other 1-D tensors stay float32), to measure block
    formats no built-in model uses. Only the formats gguf-py can quantize (not the k-quants)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType

    from app.models.dequant import dequantize
    from app.models.gguf_file import GGUFFile
    from tests.gguf_factory import write_gguf

    qtype = GGMLQuantizationType[qtype_name]
    out = folder / f"{path.stem}.{qtype_name}.gguf"
    with GGUFFile(path) as gguf:
        metadata = {k: v for k, v in gguf.metadata.items()
                    if k not in ("general.architecture", "general.alignment")}
        tensors = {}
        for name, info in gguf.tensors.items():
            raw = gguf.raw_tensor(name)
            shape = tuple(int(d) for d in info.shape)
            w = dequantize(raw, info.ggml_type, shape).numpy().astype(np.float32)
            tensors[name] = (w, qtype) if len(shape) == 2 else w
        write_gguf(out, arch=gguf.architecture, metadata=metadata, tensors=tensors)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--formats", default="float32,int4,auto,float16,bfloat16")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=8,
                        help="tokens a pass when scoring the text (see the module docstring)")
    parser.add_argument("--shared", type=Path, default=None)
    parser.add_argument("--requantize", default="",
                        help="comma-separated block formats (Q4_0,Q4_1,Q5_0,Q5_1,Q8_0): measure "
                             "--formats on a copy of the model re-quantized to each, too")
    parser.add_argument("--kv", default="policy",
                        help="comma-separated KV cache dtypes to measure each format with "
                             "(policy: what the load plan says; float32, bfloat16)")
    parser.add_argument("--skip-shipped", action="store_true",
                        help="with --requantize: only the re-quantized copies")
    args = parser.parse_args()

    from app.cli import resolve_model_path

    path = resolve_model_path(args.model, None)
    for qtype in filter(None, args.requantize.split(",")):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ferrox-quality-") as folder:
            measure_file(requantized_copy(path, qtype, Path(folder)), args, label=qtype)
    if not args.skip_shipped:
        measure_file(path, args, label="as shipped")
    return 0


def measure_file(path: Path, args, label: str) -> None:
    from app.engine.device import load_on
    from app.models.prompt import bos_prefix

    import dataclasses

    base, base_tokens = None, None
    runs = [(fmt, kv) for fmt in args.formats.split(",") for kv in args.kv.split(",")]
    for fmt, kv in runs:
        loaded = load_on(path, "cpu", fmt)
        if kv != "policy":
            loaded.load_plan = dataclasses.replace(loaded.load_plan, kv_dtype=getattr(torch, kv))
        tok = loaded.tokenizer
        ids = (bos_prefix(tok) + tok.encode(license_text()))[: args.tokens]
        prompts = reference_prompts(loaded.name, args.shared)
        scored = score(loaded, ids, args.chunk, reference=base)
        nll = scored["nll"]
        outs = [greedy(loaded, p, args.greedy_tokens) for p in prompts]
        if base is None:
            base, base_tokens = scored, outs
        base_nll = base["nll"]
        agree = sum(a == b for a, b in zip(outs, base_tokens))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                      for a, b in zip(outs, base_tokens)]
        print(json.dumps({"model": loaded.name, "file": f"{path.name} ({label})", "format": fmt,
                          "weights": loaded.weights_label,
                          "kv": str(loaded.kv_dtype).removeprefix("torch."),
                          "tokens": len(ids), "mean_nll": round(nll, 5),
                          "vs_first_pct": round(100 * (nll - base_nll) / base_nll, 3),
                          "perplexity": round(math.exp(nll), 3),
                          "kl_vs_first": round(scored.get("kl", 0.0), 6),
                          "text_argmax_same": round(scored.get("argmax_same", 1.0), 4),
                          "greedy_same": f"{agree}/{len(outs)}", "first_difference_at": first_diff}),
              flush=True)
        loaded.unload()


if __name__ == "__main__":
    sys.exit(main())
