"""Every way a remote can fail ends the reply with one Failed event a person can read; nothing
raises into the caller, and text already streamed stays delivered."""

from __future__ import annotations

import socket

import pytest

from app.backends.base import BackendError
from app.backends.remote import RemoteBackend, RemoteSettings
from app.backends.remote_errors import parse_retry_after
from app.engine.events import Failed, Token
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message
from tests.backends import transcripts as t
from tests.backends.helpers import Collector
from tests.backends.sse_server import TranscriptServer, json_answer, silent_answer, sse_answer

CHAT = [Message("user", "Say hello.")]


@pytest.fixture
def server():
    with TranscriptServer() as srv:
        srv.route("GET", "/v1/models", json_answer(200, t.VLLM_MODELS))
        yield srv


def failure_of(base_url: str, *, model=t.VLLM_MODEL, load=True, **settings) -> tuple[Failed, Collector]:
    backend = RemoteBackend(RemoteSettings(base_url, **settings))
    if load:
        backend.load(model)
    else:  # the server cannot be asked: a chat's remembered model
        backend.use_model(model)
    events = Collector()
    backend.submit_chat(CHAT, SamplingParams(max_tokens=8), events, session_id="s")
    end = events.wait()
    backend.close()
    assert isinstance(end, Failed), end
    return end, events


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_connection_refused():
    port = closed_port()
    end, _ = failure_of(f"http://127.0.0.1:{port}/v1", load=False)
    assert end.message == (f"Nothing is answering at 127.0.0.1:{port} (connection refused). "
                           "Is the server running, and is the port right?")
    with pytest.raises(BackendError, match="connection refused"):
        RemoteBackend(RemoteSettings(f"http://127.0.0.1:{port}/v1")).load("x")


def test_dns_failure():
    end, _ = failure_of("http://nonexistent.invalid:8000/v1", load=False)  # .invalid never resolves
    assert end.message == "The server name 'nonexistent.invalid' could not be found (DNS). Check the base URL."


def test_tls_error_when_the_server_speaks_plain_http(server):
    url = server.base_url.replace("http://", "https://")
    end, _ = failure_of(url, load=False)
    assert end.message.startswith(f"A secure (TLS) connection to 127.0.0.1:{server.server_address[1]} "
                                  "could not be made (")
    assert end.message.endswith("Check whether the server speaks https or plain http, and its certificate.")


@pytest.mark.parametrize("body", [t.VLLM_401, t.LLAMA_CPP_401])
def test_401_wrong_api_key(server, body):
    server.route("POST", "/v1/chat/completions", json_answer(401, body))
    end, _ = failure_of(server.base_url, api_key="sk-wrong")
    detail = "Unauthorized" if body is t.VLLM_401 else "Invalid API Key"
    assert end.message == (f"The server at 127.0.0.1:{server.server_address[1]} refused the API key "
                           f"(401): {detail} Check the connection's API key.")
    assert end.retry_after is None


@pytest.mark.parametrize("body, detail", [(t.VLLM_404, "The model `nope` does not exist."),
                                          (t.OLLAMA_404, 'model "nope" not found, try pulling it first')])
def test_404_model(server, body, detail):
    server.route("POST", "/v1/chat/completions", json_answer(404, body))
    end, _ = failure_of(server.base_url, model="nope", load=False)
    assert end.message == (f"The server at 127.0.0.1:{server.server_address[1]} has no model 'nope' or "
                           f"no such endpoint (404): {detail} Pick a model from the server's list, and "
                           "check that the base URL ends in /v1.")


def test_429_with_retry_after(server):
    server.route("POST", "/v1/chat/completions", json_answer(429, t.RATE_LIMITED, {"Retry-After": "7"}))
    end, _ = failure_of(server.base_url)
    assert end.retry_after == 7.0
    assert end.message == (f"The server at 127.0.0.1:{server.server_address[1]} is busy or rate-limited "
                           "(429): Rate limit reached for requests Try again in 7 s.")


def test_500(server):
    server.route("POST", "/v1/chat/completions", json_answer(500, t.SGLANG_500))
    end, _ = failure_of(server.base_url)
    assert end.message == (f"The server at 127.0.0.1:{server.server_address[1]} failed (500 Internal "
                           "Server Error): Internal server error: CUDA out of memory.")


def test_503_html_page_is_cut_to_one_line(server):
    page = b"<html><body><h1>503 Service Unavailable</h1>\n" + b"x" * 2000 + b"</body></html>"
    server.route("POST", "/v1/chat/completions", json_answer(503, page, {"Retry-After": "30"}))
    end, _ = failure_of(server.base_url)
    assert end.retry_after == 30.0 and "\n" not in end.message and len(end.message) < 500
    assert "failed (503 Service Unavailable): <html><body><h1>503 Service Unavailable</h1>" in end.message


def test_timeout_when_the_server_stalls(server):
    server.route("POST", "/v1/chat/completions", silent_answer)
    end, _ = failure_of(server.base_url, timeout_s=0.5)
    assert end.message == (f"The server at 127.0.0.1:{server.server_address[1]} stopped answering for "
                           "0.5 s, so the request was given up. It may be overloaded; try again.")


def test_timeout_mid_reply_keeps_the_text(server):
    server.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream(), stall_after=3))
    end, events = failure_of(server.base_url, timeout_s=0.5)
    assert events.text == "Hello there"
    assert end.message.endswith("stopped answering for 0.5 s, so the request was given up; the text "
                                "so far is kept.")


@pytest.mark.parametrize("stream", [t.vllm_stream(), t.llama_cpp_stream()])
def test_stream_cut_mid_reply(server, stream):
    server.route("POST", "/v1/chat/completions", sse_answer(stream, cut_after=2))
    end, events = failure_of(server.base_url)
    assert [type(e) for e in events.events] == [Token] * (len(events.events) - 1) + [Failed]
    assert events.text in ("Hello", "Hello there")
    assert end.message == (f"The connection to 127.0.0.1:{server.server_address[1]} was cut in the "
                           "middle of the reply; the text so far is kept.")


def test_stream_ending_without_finish_is_a_cut(server):
    server.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream()[:3]))  # clean end, no finish
    end, events = failure_of(server.base_url)
    assert events.text == "Hello there" and "cut in the middle of the reply" in end.message


def test_error_inside_the_stream(server):
    stream = t.vllm_stream()[:2] + [t.sse(t.MID_STREAM_ERROR)]
    server.route("POST", "/v1/chat/completions", sse_answer(stream))
    end, events = failure_of(server.base_url)
    assert events.text == "Hello"
    assert end.message == (f"The server at 127.0.0.1:{server.server_address[1]} reported an error during "
                           "the reply: The engine died unexpectedly.; the text so far is kept.")


def test_a_listener_that_raises_does_not_lose_the_end(server):
    server.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream()))
    backend = RemoteBackend(RemoteSettings(server.base_url))
    backend.load(t.VLLM_MODEL)
    events = Collector()

    def clumsy(event):
        events(event)
        if isinstance(event, Token):
            raise RuntimeError("listener bug")

    backend.submit_chat(CHAT, SamplingParams(), clumsy)
    assert events.wait().text == "Hello there!"


def test_no_model_loaded_is_a_failed_event_not_an_exception():
    backend = RemoteBackend(RemoteSettings("http://127.0.0.1:9/v1"))
    events = Collector()
    backend.submit_chat(CHAT, SamplingParams(), events)
    assert events.wait().message == "No remote model is chosen. Pick one in the model picker."


@pytest.mark.parametrize("value, expected", [("12", 12.0), ("0.5", 0.5), ("-3", 0.0), ("soon", None),
                                             (None, None), ("Wed, 02 Dec 2026 21:00:30 GMT", 30.0)])
def test_retry_after_forms(value, expected):
    from email.utils import parsedate_to_datetime

    now = parsedate_to_datetime("Wed, 02 Dec 2026 21:00:00 GMT").timestamp()
    assert parse_retry_after(value, now=now) == expected


def test_a_server_that_never_answers_the_model_list_is_reported_in_seconds(server):
    """It accepted the connection (still loading, or hung): the model list gives up after the
    short query timeout, not the reply's long one."""
    server.route("GET", "/v1/models", silent_answer)
    backend = RemoteBackend(RemoteSettings(server.base_url, timeout_s=300, query_timeout_s=0.5))
    with pytest.raises(BackendError) as caught:
        backend.list_models()
    backend.close()
    assert str(caught.value) == (f"The server at 127.0.0.1:{server.server_address[1]} stopped "
                                 "answering for 0.5 s, so the request was given up. It may be "
                                 "overloaded; try again.")
