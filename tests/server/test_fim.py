"""Completions `suffix`: fill-in-the-middle prompts for vocabularies with FIM tokens (here a
real byte-level BPE tokenizer trained on the spot, StarCoder-style), a clear 400 otherwise."""

from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from app.models.tokenizer import tokenizer_from_hf_folder
from app.server.fim import fim_prompt, fim_token_ids
from tests.server.conftest import MODEL_ID, SAFETY_TIMEOUT_S

FIM = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
CODE = ["def add(a, b):\n    return a + b\n", "def mul(a, b):\n    return a * b\n",
        "for i in range(10):\n    print(i)\n"] * 20


def _bpe_folder(tmp_path, special: list[str], bos: str | None = None):
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CODE, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", *special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>"}
    if bos:
        config.update(bos_token=bos, add_bos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer_from_hf_folder(tmp_path)


def test_fim_prompt_is_prefix_suffix_middle(tmp_path):
    tokenizer = _bpe_folder(tmp_path, FIM)
    pre, suf, mid = fim_token_ids(tokenizer)
    assert [tokenizer.piece(i) for i in (pre, suf, mid)] == FIM
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    ids = fim_prompt(tokenizer, prefix, suffix)
    assert ids == [pre, *tokenizer.encode(prefix), suf, *tokenizer.encode(suffix), mid]
    assert tokenizer.decode(ids, skip_special=False) == (
        f"<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>")


def test_fim_prompt_starts_with_bos_when_the_model_wants_one(tmp_path):
    tokenizer = _bpe_folder(tmp_path, ["<s>", "<|fim_prefix|>", "<|fim_suffix|>",
                                       "<|fim_middle|>"], bos="<s>")
    ids = fim_prompt(tokenizer, "a", "b")
    assert ids[0] == tokenizer.bos_id and tokenizer.piece(ids[1]) == "<|fim_prefix|>"


def test_a_vocabulary_without_fim_tokens_has_no_fim_prompt(tmp_path):
    assert fim_prompt(_bpe_folder(tmp_path, []), "a", "b") is None


def test_suffix_on_a_model_without_fim_is_a_400(tiny_server):
    response = httpx.post(f"{tiny_server.url}/completions", timeout=SAFETY_TIMEOUT_S,
                          json={"model": MODEL_ID, "prompt": "def f(", "suffix": "):\n",
                                "max_tokens": 4})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "suffix" and "FIM" in error["message"]
    # An empty suffix is no suffix (OpenAI's default).
    response = httpx.post(f"{tiny_server.url}/completions", timeout=SAFETY_TIMEOUT_S,
                          json={"model": MODEL_ID, "prompt": "def f(", "suffix": "",
                                "max_tokens": 2})
    assert response.status_code == 200


@pytest.mark.parametrize("suffix", [5, ["x"]])
def test_suffix_must_be_text(tiny_server, suffix):
    response = httpx.post(f"{tiny_server.url}/completions", timeout=SAFETY_TIMEOUT_S,
                          json={"model": MODEL_ID, "prompt": "x", "suffix": suffix,
                                "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"
