"""Indexing documents once and finding the passages that answer a question.

`DocumentLibrary` ties the pieces together: text out of a file (app.documents, with its
limits), passages (`split_passages`), vectors (`SentenceEncoder`, loaded on first use) and
the persistent `RetrievalIndex`. Retrieval fuses the vector ranking with the BM25 keyword
ranking by reciprocal rank (each list's rank r contributes 1 / (60 + r)), which keeps exact
names and numbers findable where embeddings blur them.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.documents.formats import CODE, CSV, JSON
from app.retrieval.index import RetrievalIndex, StoredPassage, embed_missing
from app.retrieval.passages import split_passages

ENCODER_ID = "all-MiniLM-L6-v2/passages-200-40"  # model + splitting: a change re-indexes
_RRF_K = 60
_CANDIDATES = 30


@dataclass(frozen=True)
class Retrieved:
    number: int  # 1-based, as cited in the prompt and the reply: [1], [2], ...
    passage: StoredPassage
    score: float


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class DocumentLibrary:
    def __init__(self, index_path: Path, models_dir: Path, encoder_factory: Callable | None = None,
                 embed_batch: int = 32):
        self.index = RetrievalIndex(index_path)
        self.embed_batch = embed_batch  # passages per stored batch: what a cancel keeps
        self.models_dir = Path(models_dir)
        self._encoder_factory = encoder_factory or self._default_encoder
        self._encoder = None

    def _default_encoder(self):
        from app.retrieval.embedding_model import ensure_embedding_model
        from app.retrieval.encoder import SentenceEncoder

        return SentenceEncoder(ensure_embedding_model(self.models_dir))

    @property
    def encoder(self):
        if self._encoder is None:
            self._encoder = self._encoder_factory()
        return self._encoder

    def close(self) -> None:
        self.index.close()

    def index_file(self, path: Path, *, cancel: threading.Event | None = None,
                   progress: Callable[[int, int], None] | None = None) -> int:
        """The document's id, indexing it first unless this exact file was indexed before;
        resumes an interrupted run. Raises DocumentError for an unreadable file and
        IndexCancelled when `cancel` is set."""
        from app.documents import extract_text

        path = Path(path)
        sha = file_sha256(path)
        found = self.index.find_document(sha, ENCODER_ID)
        if found is not None and found[1]:
            return found[0]
        if found is None:
            doc = extract_text(path, cancel=cancel)
            # Source code and data: their "# ..." lines are comments, not headings.
            passages = split_passages(doc.text, self.encoder.count_tokens,
                                      headings=doc.kind not in (CODE, CSV, JSON))
            doc_id = self.index.add_document(sha, ENCODER_ID, path.name, str(path), passages)
        else:
            doc_id = found[0]
        embed_missing(self.index, doc_id, lambda texts: self.encoder.encode(texts).numpy(),
                      batch=self.embed_batch, cancel=cancel, progress=progress)
        return doc_id

    def retrieve(self, question: str, document_ids: Sequence[int], k: int = 5) -> list[Retrieved]:
        matrix, ids = self.index.vectors(document_ids)
        scores: dict[int, float] = {}
        if len(ids):
            query = self.encoder.encode([question]).numpy()[0]
            similarity = matrix @ query
            for rank, row in enumerate(np.argsort(-similarity)[:_CANDIDATES]):
                scores[ids[row]] = scores.get(ids[row], 0.0) + 1.0 / (_RRF_K + rank + 1)
        for rank, pid in enumerate(self.index.keyword_search(question, document_ids, _CANDIDATES)):
            scores[pid] = scores.get(pid, 0.0) + 1.0 / (_RRF_K + rank + 1)
        best = sorted(scores, key=lambda pid: -scores[pid])[:k]
        stored = self.index.passages(best)
        return [Retrieved(n, stored[pid], scores[pid]) for n, pid in enumerate(best, 1) if pid in stored]
