"""The engine on its own thread: submit and abort from other threads."""

from __future__ import annotations

import threading

import pytest

from app.engine.engine import Engine, EngineConfig
from app.engine.events import Failed, Finished, Token
from app.engine.runner import EngineRunner
from app.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def runner(tiny):
    runner = EngineRunner(Engine(tiny, EngineConfig(page_size=4, kv_tokens=2048)))
    yield runner
    runner.close()


def test_stream_yields_tokens_then_finished(runner):
    events = list(runner.stream([2, 100, 200, 300], GREEDY))
    assert sum(isinstance(e, Token) for e in events) == 8
    assert isinstance(events[-1], Finished)


def test_two_threads_stream_at_once(runner):
    results = {}

    def chat(name, ids):
        results[name] = [e for e in runner.stream(ids, GREEDY) if isinstance(e, Finished)]

    threads = [threading.Thread(target=chat, args=(f"t{i}", [2, 50 + i, 60, 70])) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len(r) == 1 and r[0].usage.completion_tokens == 8 for r in results.values())


def test_abort_from_another_thread(runner):
    done = threading.Event()
    seen = []

    def listener(event):
        seen.append(event)
        if isinstance(event, Token) and len([e for e in seen if isinstance(e, Token)]) == 2:
            threading.Thread(target=runner.abort, args=(event.request_id,)).start()
        if isinstance(event, (Finished, Failed)):
            done.set()

    runner.submit([2, 5, 6, 7], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True),
                  listener)
    assert done.wait(60)
    assert seen[-1].finish_reason == "abort"
    assert seen[-1].usage.completion_tokens < 1000


def test_leaving_a_stream_early_aborts_it(runner):
    stream = runner.stream([2, 9, 9, 9], SamplingParams(max_tokens=1000, temperature=0,
                                                         ignore_eos=True))
    for event in stream:
        if isinstance(event, Token):
            break
    stream.close()
    finished = list(runner.stream([2, 1, 1, 1], GREEDY))[-1]
    assert isinstance(finished, Finished)  # the engine is free again


def test_close_aborts_what_is_running(tiny):
    runner = EngineRunner(Engine(tiny, EngineConfig(page_size=4, kv_tokens=2048)))
    done = threading.Event()
    last = []
    runner.submit([2, 3, 4], SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True),
                  lambda e: (last.append(e), isinstance(e, Finished) and done.set()))
    runner.close()
    assert done.wait(10) and last[-1].finish_reason == "abort"


def test_submit_after_close_fails_at_once(tiny):
    runner = EngineRunner(Engine(tiny, EngineConfig(page_size=4, kv_tokens=2048)))
    runner.close()
    seen = []
    runner.submit([2, 3], GREEDY, seen.append)
    assert isinstance(seen[0], Failed) and "shut down" in seen[0].message
