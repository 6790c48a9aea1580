"""The retrieval index: passages, their vectors and a keyword index in SQLite.

One database file (`retrieval.sqlite3`) beside the chats. A document is identified by the
sha256 of its file's bytes, so an unchanged file is never indexed twice, and a changed one
gets a new entry. Indexing is resumable: every passage is written first (without a vector),
then vectors are filled in batches, each batch its own transaction; a cancelled or killed
indexing run continues where it stopped.

Vectors are float32 blobs searched with numpy: a desktop's documents make thousands of
passages, not millions, and a brute-force dot product over 10,000 x 384 floats takes about a
millisecond -- the `sqlite-vec` extension would add a native dependency for no measurable
gain at this scale. Keyword search uses SQLite's built-in FTS5 (BM25 ranking).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.retrieval.passages import Passage

SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY,
    sha256 TEXT NOT NULL,
    encoder TEXT NOT NULL,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    passages INTEGER NOT NULL,
    complete INTEGER NOT NULL DEFAULT 0,
    used_at REAL NOT NULL,
    UNIQUE (sha256, encoder)
);
CREATE TABLE IF NOT EXISTS passages (
    id INTEGER PRIMARY KEY,
    document_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    text TEXT NOT NULL,
    page INTEGER,
    heading TEXT,
    vector BLOB,
    UNIQUE (document_id, idx)
);
CREATE VIRTUAL TABLE IF NOT EXISTS passages_fts USING fts5(text, content='passages', content_rowid='id');
"""


class IndexCancelled(Exception):
    """Indexing stopped because its cancel flag was set; what was done is kept."""


@dataclass(frozen=True)
class StoredPassage:
    id: int
    document_id: int
    document_name: str
    passage: Passage


class RetrievalIndex:
    """Thread-confined: open one per thread (SQLite connections are not shared)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self._vectors: dict[tuple[int, ...], tuple[np.ndarray, list[int]]] = {}

    def close(self) -> None:
        self.db.close()

    # ---- documents -------------------------------------------------------------------------

    def find_document(self, sha256: str, encoder: str) -> tuple[int, bool] | None:
        """(id, complete) of an indexed file, or None."""
        row = self.db.execute("SELECT id, complete FROM documents WHERE sha256=? AND encoder=?",
                              (sha256, encoder)).fetchone()
        return (row[0], bool(row[1])) if row else None

    def add_document(self, sha256: str, encoder: str, name: str, path: str,
                     passages: Sequence[Passage]) -> int:
        """Write a document's passages (no vectors yet) in one transaction."""
        with self.db:
            cur = self.db.execute(
                "INSERT INTO documents (sha256, encoder, name, path, passages, used_at) VALUES (?,?,?,?,?,?)",
                (sha256, encoder, name, path, len(passages), time.time()))
            doc_id = cur.lastrowid
            for p in passages:
                pid = self.db.execute(
                    "INSERT INTO passages (document_id, idx, text, page, heading) VALUES (?,?,?,?,?)",
                    (doc_id, p.index, p.text, p.page, p.heading)).lastrowid
                self.db.execute("INSERT INTO passages_fts (rowid, text) VALUES (?, ?)", (pid, p.text))
        return doc_id

    def missing_vectors(self, document_id: int) -> list[tuple[int, str]]:
        return self.db.execute("SELECT id, text FROM passages WHERE document_id=? AND vector IS NULL "
                               "ORDER BY idx", (document_id,)).fetchall()

    def store_vectors(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        with self.db:
            self.db.executemany("UPDATE passages SET vector=? WHERE id=?",
                                [(v.astype("<f4").tobytes(), i) for i, v in zip(ids, vectors)])

    def mark_complete(self, document_id: int) -> None:
        with self.db:
            self.db.execute("UPDATE documents SET complete=1, used_at=? WHERE id=?", (time.time(), document_id))
        self._vectors.clear()

    def delete_document(self, document_id: int) -> None:
        with self.db:
            for (pid, text) in self.db.execute("SELECT id, text FROM passages WHERE document_id=?",
                                               (document_id,)).fetchall():
                self.db.execute("INSERT INTO passages_fts (passages_fts, rowid, text) VALUES ('delete', ?, ?)",
                                (pid, text))
            self.db.execute("DELETE FROM documents WHERE id=?", (document_id,))
        self._vectors.clear()

    # ---- search ----------------------------------------------------------------------------

    def vectors(self, document_ids: Sequence[int]) -> tuple[np.ndarray, list[int]]:
        """[n, 384] vectors and passage ids of the given documents (cached until a change)."""
        key = tuple(sorted(document_ids))
        cached = self._vectors.get(key)
        if cached is None:
            marks = ",".join("?" * len(key))
            rows = self.db.execute(f"SELECT id, vector FROM passages WHERE document_id IN ({marks}) "
                                   "AND vector IS NOT NULL ORDER BY id", key).fetchall()
            ids = [r[0] for r in rows]
            matrix = (np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(len(rows), -1)
                      if rows else np.zeros((0, 0), np.float32))
            cached = self._vectors[key] = (matrix, ids)
        return cached

    def keyword_search(self, query: str, document_ids: Sequence[int], limit: int) -> list[int]:
        """Passage ids ranked by BM25 for any of the query's words."""
        words = [w for w in "".join(c if c.isalnum() else " " for c in query.lower()).split() if len(w) > 1]
        if not words or not document_ids:
            return []
        match = " OR ".join(f'"{w}"' for w in dict.fromkeys(words))
        marks = ",".join("?" * len(document_ids))
        rows = self.db.execute(
            f"SELECT passages_fts.rowid FROM passages_fts JOIN passages p ON p.id = passages_fts.rowid "
            f"WHERE passages_fts MATCH ? AND p.document_id IN ({marks}) ORDER BY bm25(passages_fts) LIMIT ?",
            (match, *document_ids, limit)).fetchall()
        return [r[0] for r in rows]

    def passages(self, ids: Sequence[int]) -> dict[int, StoredPassage]:
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self.db.execute(
            f"SELECT p.id, p.document_id, d.name, p.idx, p.text, p.page, p.heading FROM passages p "
            f"JOIN documents d ON d.id = p.document_id WHERE p.id IN ({marks})", tuple(ids)).fetchall()
        return {r[0]: StoredPassage(r[0], r[1], r[2], Passage(r[3], r[4], r[5], r[6])) for r in rows}


def embed_missing(index: RetrievalIndex, document_id: int, encode: Callable[[list[str]], np.ndarray],
                  *, batch: int = 32, cancel: threading.Event | None = None,
                  progress: Callable[[int, int], None] | None = None) -> None:
    """Fill the document's missing vectors batch by batch; raises IndexCancelled when
    `cancel` is set (the batches already stored stay)."""
    todo = index.missing_vectors(document_id)
    total = index.db.execute("SELECT passages FROM documents WHERE id=?", (document_id,)).fetchone()[0]
    done = total - len(todo)
    for start in range(0, len(todo), batch):
        if cancel is not None and cancel.is_set():
            raise IndexCancelled()
        rows = todo[start:start + batch]
        index.store_vectors([r[0] for r in rows], np.asarray(encode([r[1] for r in rows]), dtype=np.float32))
        done += len(rows)
        if progress is not None:
            progress(done, total)
    index.mark_complete(document_id)
