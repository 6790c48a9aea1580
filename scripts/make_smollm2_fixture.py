#!/usr/bin/env python3
"""Dev-only: regenerate tests/fixtures/smollm2_reference.json with transformers as the oracle.

Needs `pip install transformers accelerate` (test/dev tools, never runtime dependencies).
Two chat prompts (ChatML, as SmolLM2's own template renders them, with its default system
line) go through transformers in float32 on gguf-py-dequantized weights; the fixture keeps
the top-10 logits of the first step, 32 greedy tokens and each greedy step's top-5 logprobs.

    python scripts/make_smollm2_fixture.py SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2_reference.json"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def chatml(question: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(sys.argv[1]).resolve()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cases = []
    for question in QUESTIONS:
        ids = tok.encode(chatml(question), add_special_tokens=False)
        with torch.no_grad():
            first = model(torch.tensor([ids])).logits[0, -1]
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        values, top = torch.topk(first, 10)
        steps = []
        for logits in out.logits:
            logprobs = torch.log_softmax(logits[0].float(), -1)
            lp, li = torch.topk(logprobs, 5)
            steps.append({"top5_ids": li.tolist(), "top5_logprobs": [round(v, 5) for v in lp.tolist()]})
        greedy = out.sequences[0, len(ids):].tolist()
        cases.append({"question": question, "prompt_ids": ids,
                      "top10_ids": top.tolist(), "top10_logits": [round(v, 5) for v in values.tolist()],
                      "greedy_ids": greedy, "greedy_text": tok.decode(greedy, skip_special_tokens=True),
                      "steps": steps})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "source": "transformers float32, eager attention, gguf-py-dequantized weights",
        "model_sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
        "cases": cases}, indent=1))
    print(f"wrote {OUT}")
    for case in cases:
        print(repr(case["greedy_text"]))


if __name__ == "__main__":
    main()
