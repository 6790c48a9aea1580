"""Our tokenizers give llama.cpp's ids, text for text, on both built-in models.

The fixtures (tests/fixtures/tokenizer_ids_<model>.json) hold llama.cpp's ids for a few hundred
varied texts (prose, code, numbers, contractions, whitespace runs, emoji, CJK, Arabic,
combining marks, special-token strings), each with special tokens off and on; they are made by
scripts/make_tokenizer_fixture.py with llama-cpp-python. SmolLM2 exercises the byte-level BPE
path (`tokenizer.ggml.pre = smollm`), Gemma 3 the SentencePiece path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.models import embedded
from app.models.errors import ModelError
from app.models.gguf_file import GGUFFile
from app.models.tokenizer import tokenizer_from_gguf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# built-in model key -> its fixture
MODELS = {
    "smollm2-135m-instruct": "tokenizer_ids_smollm2-135m-instruct.q4_1.json",
    "gemma-3-270m": "tokenizer_ids_gemma-3-270m-q4_k_m.json",
}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    shared = os.environ.get("FERROX_TEST_MODEL_DIR")
    return Path(shared) if shared else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request, models_dir):
    """(fixture, tokenizer) for one built-in model; skipped only when its package is missing."""
    key = request.param
    try:
        _, expected_sha256 = embedded.builtin_model(key).sources()
    except ModelError as exc:
        pytest.skip(f"built-in model {key} is not installed: {exc}")
    fixture = json.loads((FIXTURES / MODELS[key]).read_text("utf-8"))
    # The ids belong to one exact file: a different build of the model may tokenize otherwise.
    assert fixture["sha256"] == expected_sha256, f"{MODELS[key]} was made from another file"
    path = embedded.ensure_builtin_model(key, models_dir)
    assert fixture["model"] == path.name
    with GGUFFile(path) as gguf:
        tok = tokenizer_from_gguf(gguf)
    return fixture, tok


def _show(ids_a, ids_b) -> str:
    return f"ours {ids_a} vs llama.cpp {ids_b}"


def test_fixture_covers_enough(case):
    fixture, _ = case
    cases = fixture["cases"]
    assert len({c["text"] for c in cases}) >= 300
    assert {c["special"] for c in cases} == {False, True}
    by_text: dict[str, dict[bool, list[int]]] = {}
    for c in cases:
        by_text.setdefault(c["text"], {})[c["special"]] = c["ids"]
    # Special-token strings are tokenized differently with special on: the fixture tests both.
    assert any(v[True] != v[False] for v in by_text.values())


def test_ids_match_llama_cpp(case):
    fixture, tok = case
    mismatches = []
    for c in fixture["cases"]:
        ours = tok.encode(c["text"], special=c["special"])
        if ours != c["ids"]:
            mismatches.append(f"special={c['special']} {c['text']!r}: {_show(ours, c['ids'])}")
    assert not mismatches, (f"{len(mismatches)} of {len(fixture['cases'])} texts differ:\n"
                            + "\n".join(mismatches[:20]))


def test_special_token_flags_match_llama_cpp(case):
    fixture, tok = case
    assert tok.add_bos == fixture["add_bos"]
    # The SentencePiece tokenizer has no add_eos: it never appends EOS, as llama.cpp says for Gemma.
    assert getattr(tok, "add_eos", False) == fixture["add_eos"]
    assert tok.bos_id == fixture["bos_id"]
    assert tok.eos_id == fixture["eos_id"]


def test_control_tokens_match_llama_cpp(case):
    """The tokens that are special (matched only with special=True, hidden when decoding) are
    llama.cpp's CONTROL set after loading, which may differ from the file's token types."""
    fixture, tok = case
    ours, theirs = set(tok.control_ids), set(fixture["control_ids"])
    assert ours == theirs, (f"only ours: {sorted(ours - theirs)[:20]}; "
                            f"only llama.cpp: {sorted(theirs - ours)[:20]}")


def test_llama_cpp_ids_decode_to_the_text(case):
    """Decoding llama.cpp's ids gives the text back (special tokens rendered as text)."""
    fixture, tok = case
    wrong = []
    for c in fixture["cases"]:
        text = tok.decode(c["ids"], skip_special=False)
        if text != c["text"]:
            wrong.append(f"special={c['special']} {c['text']!r} decodes to {text!r}")
    assert not wrong, f"{len(wrong)} texts do not round-trip:\n" + "\n".join(wrong[:20])
