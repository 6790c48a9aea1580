"""`app serve` answers while its model loads: a 503 that says so (not a request left waiting
in the socket's queue), then the model's API once it is ready; a model that arrives after
the shutdown began is closed, not served."""

from __future__ import annotations

import threading
import time

import httpx
from app.engine.engine import Engine, EngineConfig
from app.engine.events import Failed
from app.engine.runner import EngineRunner
from app.engine.sampling import SamplingParams
from app.server.api import create_app
from app.server.serve import (LOADING, LOADING_RETRY_AFTER_S, ApiServer, listen,
                              loading_switchboard)
from tests.server.conftest import KV_TOKENS, MODEL_ID

TIMEOUT = httpx.Timeout(600.0)


def _start(server: ApiServer):
    sock = listen("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return sock, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _loading_server() -> ApiServer:
    return ApiServer(loading_switchboard("127.0.0.1"), log_level="warning")


def test_a_loading_server_says_so_then_serves_the_model(embedded_loaded):
    server = _loading_server()
    sock, thread, root = _start(server)
    runner = EngineRunner(Engine(embedded_loaded, EngineConfig(kv_tokens=KV_TOKENS)))
    try:
        waiting = httpx.get(f"{root}/v1/models", timeout=TIMEOUT)
        assert waiting.status_code == 503
        assert waiting.json()["error"]["message"] == LOADING
        assert waiting.json()["error"]["code"] == "model_loading"
        assert waiting.headers["retry-after"] == str(LOADING_RETRY_AFTER_S)
        health = httpx.get(f"{root}/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        foreign = httpx.get(f"{root}/v1/models", headers={"Host": "evil.example"}, timeout=TIMEOUT)
        assert foreign.status_code == 400  # the Host guard holds while loading too

        app = create_app(runner, embedded_loaded, MODEL_ID, bind_host="127.0.0.1")
        assert server.serve_model(app, runner)
        models = httpx.get(f"{root}/v1/models", timeout=TIMEOUT)
        assert [m["id"] for m in models.json()["data"]] == [MODEL_ID]
        # Its context, in vLLM's field, so clients size their prompts to it.
        assert models.json()["data"][0]["max_model_len"] == embedded_loaded.context_length
        body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
        reply = httpx.post(f"{root}/v1/completions", json=body, timeout=TIMEOUT)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive()
    # The server closed the runner it was given: the engine takes no more work.
    events = list(runner.stream([1, 2, 3], SamplingParams(max_tokens=1)))
    assert isinstance(events[-1], Failed) and "shut down" in events[-1].message


def test_a_model_ready_after_the_shutdown_began_is_not_served(embedded_loaded):
    server = _loading_server()
    sock, thread, _ = _start(server)
    server.should_exit = True
    thread.join(30)
    sock.close()
    runner = EngineRunner(Engine(embedded_loaded, EngineConfig(kv_tokens=KV_TOKENS)))
    try:
        assert not server.serve_model(create_app(runner, embedded_loaded, MODEL_ID), runner)
    finally:
        runner.close()
