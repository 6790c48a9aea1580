"""The document index's own worker thread: indexing dropped documents (with progress and
cancel) and retrieving passages for a question, both off the GUI thread.

Its own QThread, not the engine bridge's: indexing a long document takes tens of seconds
and must not hold up loading a model or tokenizing a prompt. Each job runs on a thread of
its own that this one waits for (torch's OpenMP helpers end with it: app/openmp.py); the
sentence encoder is loaded once, by the first job that needs it, and the index database is
opened per job (SQLite connections belong to one thread, and opening costs well under a
millisecond), so nothing needs closing on this thread at shutdown. Signals carry plain
data: strings, ints and frozen `Retrieved` records.
"""

from __future__ import annotations

import atexit
import sqlite3
import threading
from pathlib import Path

from app.documents import DocumentError
from app.models.errors import ModelError
from app.openmp import run_on_passing_thread
from app.retrieval.ask import INDEX_FILE
from app.retrieval.index import IndexCancelled
from app.retrieval.library import ENCODER_ID, DocumentLibrary, file_sha256
from app.ui.qt import QObject, QThread, Signal, Slot


class RetrievalWorker(QObject):
    # -> worker (queued)
    _index = Signal(str, str)  # key, path
    _retrieve = Signal(str, str, object, int)  # job, question, [(sha256, name)], k

    # -> GUI
    indexProgress = Signal(str, int, int)  # key, passages embedded, of (0, 0 while splitting)
    indexed = Signal(str, str, int)  # key, sha256 of the file, passages
    indexFailed = Signal(str, str)  # key, message
    indexCancelled = Signal(str)  # key
    retrieved = Signal(str, object)  # job, list[Retrieved]
    retrieveFailed = Signal(str, str)  # job, message

    def __init__(self, data_dir: Path, models_dir: Path):
        super().__init__()
        self.index_path = Path(data_dir) / INDEX_FILE
        self.models_dir = Path(models_dir)
        self._encoder = None  # loaded once, in the worker thread
        self._cancels: dict[str, threading.Event] = {}
        self._thread = QThread()
        self._thread.setObjectName("ferrox-documents")
        self.moveToThread(self._thread)
        self._index.connect(self._do_index)
        self._retrieve.connect(self._do_retrieve)
        self._thread.start()
        # A script that never closes the window still stops the thread cleanly.
        atexit.register(self.shutdown)

    # ---- called from the GUI thread ----------------------------------------------------

    def index(self, key: str, path: str) -> None:
        """Index the file (or reuse its index); answered by indexed / indexFailed /
        indexCancelled, with indexProgress on the way."""
        self._cancels[key] = threading.Event()
        self._index.emit(key, path)

    def cancel(self, key: str) -> None:
        """Stop indexing `key` at the next batch (what was embedded is kept: attaching the
        file again resumes)."""
        event = self._cancels.get(key)
        if event is not None:
            event.set()

    def retrieve(self, job: str, question: str, sources: list[tuple[str, str]], k: int) -> None:
        """The best `k` passages of the indexed files `sources` ((sha256, name) pairs) for
        `question`; answered by retrieved or retrieveFailed."""
        self._retrieve.emit(job, question, list(sources), k)

    def shutdown(self) -> None:
        if not self._thread.isRunning():
            return
        for event in self._cancels.values():
            event.set()
        self._thread.quit()
        self._thread.wait(30_000)

    # ---- the worker thread -------------------------------------------------------------

    def _shared_encoder(self):
        if self._encoder is None:
            from app.retrieval.embedding_model import ensure_embedding_model
            from app.retrieval.encoder import SentenceEncoder

            self._encoder = SentenceEncoder(ensure_embedding_model(self.models_dir))
        return self._encoder

    def _library(self) -> DocumentLibrary:
        return DocumentLibrary(self.index_path, self.models_dir, encoder_factory=self._shared_encoder)

    # Each job runs on a thread that ends with it (app/openmp.py): the encoder's torch work
    # would otherwise leave this thread an OpenMP pool that halves the engine's decode speed.
    # The job opens and closes its own index database there, as SQLite wants.

    @Slot(str, str)
    def _do_index(self, key: str, path: str) -> None:
        run_on_passing_thread(self._index_job, key, path, name="ferrox-indexing")

    @Slot(str, str, object, int)
    def _do_retrieve(self, job: str, question: str, sources: list, k: int) -> None:
        run_on_passing_thread(self._retrieve_job, job, question, sources, k,
                              name="ferrox-retrieval")

    def _index_job(self, key: str, path: str) -> None:
        cancel = self._cancels.get(key) or threading.Event()
        library = None
        try:
            if cancel.is_set():
                raise IndexCancelled()
            self.indexProgress.emit(key, 0, 0)
            library = self._library()
            doc_id = library.index_file(Path(path), cancel=cancel,
                                        progress=lambda done, total: self.indexProgress.emit(key, done, total))
            passages = library.index.db.execute("SELECT passages FROM documents WHERE id=?",
                                                (doc_id,)).fetchone()[0]
            sha = file_sha256(Path(path))
        except IndexCancelled:
            self.indexCancelled.emit(key)
            return
        except DocumentError as exc:
            if cancel.is_set():
                self.indexCancelled.emit(key)
            else:
                self.indexFailed.emit(key, str(exc))
            return
        except (ModelError, OSError, RuntimeError, ValueError, sqlite3.Error) as exc:
            self.indexFailed.emit(key, f"The document could not be indexed for search: {exc}")
            return
        finally:
            self._cancels.pop(key, None)
            if library is not None:
                library.close()
        self.indexed.emit(key, sha, int(passages))

    def _retrieve_job(self, job: str, question: str, sources: list, k: int) -> None:
        library = None
        try:
            library = self._library()
            doc_ids, missing = [], []
            for sha, name in sources:
                found = library.index.find_document(sha, ENCODER_ID)
                if found is not None and found[1]:
                    doc_ids.append(found[0])
                else:
                    missing.append(name)
            if not doc_ids:
                self.retrieveFailed.emit(job, f"The search index of {', '.join(missing)} is missing "
                                              "(attach the document again to index it).")
                return
            results = library.retrieve(question, doc_ids, k)
        except (ModelError, OSError, RuntimeError, ValueError, sqlite3.Error) as exc:
            self.retrieveFailed.emit(job, f"Searching the documents failed: {exc}")
            return
        finally:
            if library is not None:
                library.close()
        self.retrieved.emit(job, results)
