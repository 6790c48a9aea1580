"""`generate --prompt-ids ... --dtype float32 --top-logprobs 10 --json` and `tokenize --jsonl`
work for every family, from its GGUF and its Hugging Face folder (tiny random-weight models made
with transformers' config classes): the top-10 alternatives of the first generated token are
transformers' own, and tokenize answers one id list per input line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.tiny_models import CASES, make_tiny_model
from tests.test_cli import run_app

FAMILIES = sorted({case.family: key for key, case in CASES.items() if not case.deep}.values())


@pytest.mark.slow
@pytest.mark.parametrize("key", FAMILIES)
def test_generate_and_tokenize_from_the_command_line(key, tmp_path):
    tiny = make_tiny_model(key, tmp_path)
    ids = tiny.prompt_ids[:24]
    expected = torch.topk(tiny.reference_logits(ids)[-1], 10).indices.tolist()
    for model in (tiny.gguf_path, tiny.hf_dir):
        proc = run_app("generate", "--model", str(model), "--prompt-ids", ",".join(map(str, ids)),
                       "--max-tokens", "2", "--temperature", "0", "--dtype", "float32",
                       "--top-logprobs", "10", "--json", data_dir=tmp_path / "data")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["prompt_ids"] == ids and out["dtype"] == "float32"
        first = out["logprobs"][0]
        assert [t[0] for t in first["top"]] == expected  # near-ties aside, transformers' order
        assert first["id"] == expected[0]
        texts = ["hello world", "a  b\tc\n"]
        proc = run_app("tokenize", "--model", str(model), "--jsonl",
                       stdin="".join(json.dumps(t) + "\n" for t in texts), data_dir=tmp_path / "data")
        assert proc.returncode == 0, proc.stderr
        rows = [json.loads(line) for line in proc.stdout.splitlines()]
        assert len(rows) == len(texts) and all(isinstance(r, list) and r for r in rows)
