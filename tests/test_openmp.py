"""Torch work off the engine's thread runs on threads that end with it, taking their OpenMP
helper threads along (app/openmp.py)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from app.openmp import run_on_passing_thread


def test_the_work_runs_on_another_thread_that_has_ended():
    ran_on: list[threading.Thread] = []

    def work(a, b, scale=1):
        ran_on.append(threading.current_thread())
        return (a + b) * scale

    assert run_on_passing_thread(work, 2, 3, scale=10) == 50
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()


def test_what_the_work_raises_reaches_the_caller():
    def broken():
        raise ValueError("the model file is damaged")

    with pytest.raises(ValueError, match="damaged"):
        run_on_passing_thread(broken)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(count: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _threads() != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_passing_threads_openmp_helpers_end_with_it():
    """A thread that runs a parallel region keeps helper threads while it lives; run on a
    passing thread, the same work leaves none behind."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    x = torch.randn(1 << 20)

    def parallel_work():
        for _ in range(5):
            (x * 2).sum()

    try:
        baseline = _threads()
        done, release = threading.Event(), threading.Event()

        def stays():
            parallel_work()
            done.set()
            release.wait(30)

        keeper = threading.Thread(target=stays)
        keeper.start()
        done.wait(30)
        helpers = _threads() - baseline - 1  # besides the keeping thread itself
        release.set()
        keeper.join()
        if helpers < 1:
            pytest.skip("this OpenMP runtime kept no helper for the thread")
        assert _settles_at(baseline)

        run_on_passing_thread(parallel_work)
        assert _settles_at(baseline)
    finally:
        torch.set_num_threads(before)


def test_a_session_loads_and_warms_up_on_passing_threads(smollm2_model_path, monkeypatch):
    """Neither the load nor the engine's warm-up passes run on the caller's thread (the GUI's
    worker keeps no OpenMP pool), and the engine then decodes on its own thread."""
    import app.engine.session as session_module
    from app.engine.session import ModelSession

    threads: dict[str, threading.Thread] = {}
    real_load, real_engine = session_module.load_on, session_module.Engine

    def load_on(*args, **kwargs):
        threads["load"] = threading.current_thread()
        return real_load(*args, **kwargs)

    def engine(*args, **kwargs):
        threads["engine"] = threading.current_thread()
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(session_module, "load_on", load_on)
    monkeypatch.setattr(session_module, "Engine", engine)
    session = ModelSession()
    try:
        session.load(smollm2_model_path, "cpu", "auto", tune=False)
        for name in ("load", "engine"):
            assert threads[name] is not threading.current_thread(), name
            assert not threads[name].is_alive(), name
    finally:
        session.close()
