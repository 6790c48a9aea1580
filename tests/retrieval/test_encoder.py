"""all-MiniLM-L6-v2 in torch against sentence-transformers' own output."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "minilm_reference.json"


def test_vectors_match_sentence_transformers(encoder):
    ref = json.loads(FIXTURE.read_text())
    got = encoder.encode(ref["sentences"])
    expected = torch.tensor(ref["vectors"])
    assert got.shape == expected.shape == (len(ref["sentences"]), 384)
    assert (got - expected).abs().max() < 1e-4
    assert torch.allclose(got.norm(dim=1), torch.ones(len(got)), atol=1e-5)


def test_batching_does_not_change_a_vector(encoder):
    texts = ["short", "a somewhat longer sentence about the sea and the sky", "mid length text"]
    together = encoder.encode(texts)
    alone = torch.cat([encoder.encode([t]) for t in texts])
    assert (together - alone).abs().max() < 1e-5


def test_the_model_is_unpacked_once(encoder_folder, tmp_path):
    from app.retrieval.embedding_model import ensure_embedding_model

    first = ensure_embedding_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedding_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_counting_sees_whole_texts_while_encoding_cuts_at_the_limit(encoder):
    long_text = "word " * 1000
    assert encoder.count_tokens(long_text) == 1000
    assert torch.allclose(encoder.encode([long_text]), encoder.encode([long_text + " more words"]), atol=1e-6)
