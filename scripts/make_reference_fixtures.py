#!/usr/bin/env python3
"""Dev-only: regenerate tests/fixtures/gemma3_long_prompt.json with transformers as the oracle.

Needs `pip install transformers` (never a runtime or test dependency) and ~70 s to load.
The prompt is longer than Gemma 3's 512-token sliding window, so the fixture checks that
sliding layers forget what a global layer still sees.

    python scripts/make_reference_fixtures.py MODEL.gguf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gemma3_long_prompt.json"

PARAGRAPH = (
    "The lighthouse keeper wrote in her log every evening. She noted the wind, the colour of the "
    "sea, the ships that passed and the birds that rested on the railing. In winter the storms "
    "came from the north and the lamp had to be tended through the night; in summer the "
    "visitors came instead, asking about the history of the island, the old fishing village and "
    "the wreck that lay beneath the cliffs. "
)


def main() -> None:
    from transformers import AutoModelForCausalLM

    gguf = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from app.models.gguf_file import GGUFFile
    from app.models.tokenizer import Tokenizer

    with GGUFFile(gguf) as f:
        tok = Tokenizer.from_gguf(f)
    text = "".join(f"Day {i + 1}. {PARAGRAPH}" for i in range(9)) + "On the last day she wrote that"
    ids = [tok.bos_id] + tok.encode(text)
    assert len(ids) > 600, len(ids)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    checks = {}
    for pos in (300, 511, 512, 513, len(ids) - 1):
        values, top = torch.topk(logits[pos], 10)
        checks[str(pos)] = {"top10_ids": top.tolist(), "top10_logits": [round(v, 5) for v in values.tolist()]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "source": "transformers float32, eager attention, gguf-py-dequantized weights",
        "model_sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "prompt": text, "prompt_ids": ids, "positions": checks,
        "greedy_ids": out[0, len(ids):].tolist(),
    }, indent=1))
    print(f"wrote {OUT} ({len(ids)} prompt tokens)")


if __name__ == "__main__":
    main()
