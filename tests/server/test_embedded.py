"""The API server inside the app: serves the session's model on a loopback port, says so
while none is loaded, follows a model switch, and refuses a busy port clearly."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from app.engine.session import ModelSession
from app.server.embedded import NO_MODEL, STOPPED_WHY, EmbeddedServer
from app.server.serve import ServeError

TIMEOUT = httpx.Timeout(600.0)


@pytest.fixture
def session():
    session = ModelSession()
    yield session
    session.close()


@pytest.fixture
def server(session):
    server = EmbeddedServer(session, port=0)
    server.start()
    yield server
    server.stop()


def _chat(server: EmbeddedServer, text: str, **extra) -> httpx.Response:
    body = {"model": server.model_id or "any", "messages": [{"role": "user", "content": text}],
            "max_tokens": 4, "temperature": 0} | extra
    return httpx.post(f"{server.url}/chat/completions", json=body, timeout=TIMEOUT)


def test_without_a_model_every_request_hears_that_none_is_loaded(server):
    health = httpx.get(server.url.removesuffix("/v1") + "/health", timeout=TIMEOUT)
    assert health.status_code == 503 and health.json()["status"] == "no_model"
    reply = _chat(server, "Hello")
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == NO_MODEL
    assert reply.json()["error"]["code"] == "model_not_loaded"
    # The Host guard holds with no model too: a web page cannot reach the port by DNS tricks.
    foreign = httpx.get(f"{server.url}/models", headers={"Host": "evil.example"}, timeout=TIMEOUT)
    assert foreign.status_code == 400 and "Host" in foreign.json()["error"]["message"]


def test_serves_the_loaded_model_and_follows_its_unload(server, session, smollm2_model_path):
    session.load(smollm2_model_path, "cpu", "auto")
    models = httpx.get(f"{server.url}/models", timeout=TIMEOUT).json()["data"]
    assert [m["id"] for m in models] == [smollm2_model_path.stem] == [server.model_id]
    reply = _chat(server, "Say hello.")
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    session.unload()
    assert _chat(server, "Say hello.").status_code == 503
    assert server.model_id is None


def test_starting_after_the_load_serves_at_once(session, smollm2_model_path):
    session.load(smollm2_model_path, "cpu", "auto")
    server = EmbeddedServer(session, port=0)
    server.start()
    try:
        assert _chat(server, "Hi").status_code == 200
    finally:
        server.stop()
    with pytest.raises(httpx.ConnectError):  # stopped: nothing listens any more
        httpx.get(f"{server.url}/models", timeout=TIMEOUT)
    assert session.info is not None  # the window's model stays loaded


def test_a_model_switch_ends_an_open_stream_and_the_next_request_is_served(
        server, session, smollm2_model_path):
    info = session.load(smollm2_model_path, "cpu", "auto")
    ends = session._loaded.stop_token_ids  # banned: the reply runs until it is stopped
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "Count to 1000."}],
            "max_tokens": 4000, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100 for t in ends}}
    started, lines = threading.Event(), []

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/chat/completions", json=body,
                          timeout=TIMEOUT) as response:
            for line in response.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(600)
    session.load(smollm2_model_path, "cpu", "auto")  # the same file again: a new engine
    reader.join(60)
    assert not reader.is_alive(), "the stream did not end when its engine stopped"
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert len(events) < 4000 and events[-1]["error"]["message"].startswith(STOPPED_WHY)
    assert info.context_length >= 4000
    assert _chat(server, "Hi").status_code == 200


def test_a_busy_port_is_refused_clearly(session):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ServeError, match=f"Cannot listen on 127.0.0.1:{port}"):
            EmbeddedServer(session, port=port).start()
