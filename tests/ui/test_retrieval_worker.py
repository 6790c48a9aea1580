"""The document worker runs each job on a thread that ends with it (app/openmp.py), so the
encoder's torch work leaves its own thread no OpenMP helpers."""

from __future__ import annotations

import threading

from app.ui.retrieval_worker import RetrievalWorker


def test_index_and_retrieve_jobs_run_on_passing_threads(tmp_path, qtbot, monkeypatch):
    ran: dict[str, threading.Thread] = {}
    worker = RetrievalWorker(tmp_path, tmp_path / "models")
    try:
        worker_thread: list[threading.Thread] = []

        def index_job(self, key, path):
            ran["index"] = threading.current_thread()
            self.indexFailed.emit(key, "stopped by the test")

        def retrieve_job(self, job, question, sources, k):
            ran["retrieve"] = threading.current_thread()
            self.retrieveFailed.emit(job, "stopped by the test")

        def passing(fn, *args, name="", **kwargs):
            worker_thread.append(threading.current_thread())
            return real(fn, *args, name=name, **kwargs)

        import app.ui.retrieval_worker as module

        real = module.run_on_passing_thread
        monkeypatch.setattr(RetrievalWorker, "_index_job", index_job)
        monkeypatch.setattr(RetrievalWorker, "_retrieve_job", retrieve_job)
        monkeypatch.setattr(module, "run_on_passing_thread", passing)
        heard: list[str] = []  # (a plain callable runs on the emitting thread: no Qt in it)
        worker.indexFailed.connect(lambda key, message: heard.append(key))
        worker.retrieveFailed.connect(lambda job, message: heard.append(job))
        worker.index("doc", str(tmp_path / "report.txt"))
        qtbot.waitUntil(lambda: heard == ["doc"], timeout=10_000)
        worker.retrieve("job", "what?", [("sha", "report.txt")], 3)
        qtbot.waitUntil(lambda: heard == ["doc", "job"], timeout=10_000)
        for name in ("index", "retrieve"):
            assert ran[name] not in worker_thread and not ran[name].is_alive(), name
        assert threading.current_thread() not in worker_thread  # the slots ran on the worker
    finally:
        worker.shutdown()
