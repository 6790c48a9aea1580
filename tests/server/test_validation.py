"""Strict validation, the wire guards (Host, body size), /health and CORS, on a server over
the tiny random-weight model: every rule has a case, each a 4xx in OpenAI's shape before
anything runs (or, for the sampler's extremes, a reply instead of a crash)."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from app.server.guards import allowed_hosts_for, host_allowed
from tests.server.conftest import MODEL_ID, SAFETY_TIMEOUT_S, running_server, user


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/{path}", json=body, timeout=SAFETY_TIMEOUT_S, **kwargs)


def chat_body(**extra) -> dict:
    return {"model": MODEL_ID, "messages": user("Hi"), "max_tokens": 2, **extra}


def assert_error(response: httpx.Response, status: int, param: str | None,
                 code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    # A value inside a mapping is named by its key: 'logit_bias.5' is under 'logit_bias'.
    assert error["message"] and (error["param"] == param or (
        param is not None and error["param"].startswith(param + ".")))
    if code is not None:
        assert error["code"] == code
    assert "Traceback" not in response.text
    return error


# ---- types are strict ------------------------------------------------------------------


@pytest.mark.parametrize("path, extra, param", [
    ("chat/completions", {"stream": "yes"}, "stream"),
    ("chat/completions", {"stream": 1}, "stream"),
    ("chat/completions", {"logprobs": "true"}, "logprobs"),
    ("chat/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("chat/completions", {"max_tokens": "2"}, "max_tokens"),
    ("chat/completions", {"temperature": "0.5"}, "temperature"),
    ("chat/completions", {"seed": 1.5}, "seed"),
    ("chat/completions", {"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ("completions", {"echo": "false"}, "echo"),
    ("completions", {"stream": "true"}, "stream"),
])
def test_booleans_are_booleans_and_numbers_numbers(tiny_server, path, extra, param):
    body = chat_body(**extra) if path == "chat/completions" else {
        "model": MODEL_ID, "prompt": "Hi", "max_tokens": 2, **extra}
    assert_error(post(tiny_server, path, body), 400, param)


def test_not_a_number_is_refused(tiny_server):
    # Python's JSON reader takes NaN and Infinity; OpenAI's ranges cannot hold them.
    for value in ("NaN", "Infinity"):
        raw = f'{{"model": "{MODEL_ID}", "prompt": "Hi", "max_tokens": 2, "temperature": {value}}}'
        response = httpx.post(f"{tiny_server.url}/completions", content=raw,
                              headers={"content-type": "application/json"})
        assert_error(response, 400, "temperature")


# ---- rules across fields -----------------------------------------------------------------


def test_top_logprobs_requires_logprobs(tiny_server):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().chat.completions.create(model=MODEL_ID, messages=user("Hi"),
                                                     max_tokens=2, top_logprobs=2)
    assert caught.value.body["param"] == "top_logprobs"
    reply = tiny_server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Hi"), max_tokens=2, logprobs=True, top_logprobs=2)
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2


def test_stream_options_only_with_stream(tiny_server):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().chat.completions.create(
            model=MODEL_ID, messages=user("Hi"), max_tokens=2,
            stream_options={"include_usage": True})
    assert caught.value.body["param"] == "stream_options"
    assert_error(post(tiny_server, "completions", {
        "model": MODEL_ID, "prompt": "Hi", "max_tokens": 2, "stream": False,
        "stream_options": {"include_usage": True}}), 400, "stream_options")


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "Hi"}],
     "messages[0].content"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant"}], "messages[1].content"),
    ([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}],
     "messages[1].tool_call_id"),
    ([{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_content_is_required_where_openai_requires_it(tiny_server, messages, param):
    assert_error(post(tiny_server, "chat/completions", chat_body(messages=messages)), 400, param)


def test_unknown_model_is_a_404_listing_the_served_one(tiny_server):
    for call in (lambda c: c.chat.completions.create(model="gpt-4o", messages=user("Hi"),
                                                     max_tokens=2),
                 lambda c: c.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as caught:
            call(tiny_server.client())
        assert caught.value.code == "model_not_found"
        assert "gpt-4o" in caught.value.message and MODEL_ID in caught.value.message
    # No model named at all: the one served answers (curl users).
    response = post(tiny_server, "completions", {"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["model"] == MODEL_ID


def test_context_overflow_says_what_vllm_says(tiny_server):
    context = tiny_server.loaded.context_length  # 2048
    prompt = [818] * (context - 10)
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().completions.create(model=MODEL_ID, prompt=prompt, max_tokens=50)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["message"] == (
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{context + 40} tokens ({context - 10} in the messages, 50 in the completion). "
        "Please reduce the length of the messages or completion.")
    assert caught.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("path, extra, param", [
    ("chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"function_call": "auto"}, "function_call"),
    ("chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat/completions", {"verbosity": "low"}, "verbosity"),
    ("chat/completions", {"response_format": {"type": "bogus"}}, "response_format.type"),
    ("chat/completions", {"response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("completions", {"best_of": 2}, "best_of"),
])
def test_parameters_that_cannot_be_honoured_are_refused(tiny_server, path, extra, param):
    body = chat_body(**extra) if path == "chat/completions" else {
        "model": MODEL_ID, "prompt": "Hi", "max_tokens": 2, **extra}
    assert_error(post(tiny_server, path, body), 400, param)


def test_harmless_parameters_are_accepted(tiny_server):
    body = chat_body(user="me", metadata={"k": "v"}, store=False, service_tier="auto",
                     prompt_cache_key="chat-1", modalities=["text"], parallel_tool_calls=True,
                     response_format={"type": "text"})
    assert post(tiny_server, "chat/completions", body).status_code == 200


# ---- the sampler's extremes fail nobody (issue 10, point 11) ------------------------------


@pytest.mark.parametrize("extreme", [
    {"temperature": 1e-300, "top_p": 0.5},
    {"temperature": 1e-300, "top_p": 0.5, "min_p": 1.0},
    {"repetition_penalty": 1e-300, "top_p": 0.5},
])
def test_extreme_sampling_values_answer_and_fail_no_one(tiny_server, extreme):
    results: dict[int, httpx.Response] = {}
    bodies = [chat_body(max_tokens=6, **extreme), chat_body(max_tokens=6, temperature=0),
              chat_body(max_tokens=6, seed=3)]
    start = threading.Barrier(len(bodies))

    def call(i: int) -> None:
        start.wait()
        results[i] = post(tiny_server, "chat/completions", bodies[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SAFETY_TIMEOUT_S)
    for response in results.values():
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
    assert len(results) == 3


# ---- /health, CORS ---------------------------------------------------------------------


def test_health(tiny_server):
    response = httpx.get(f"{tiny_server.root}/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_cors_only_for_the_origins_given(tiny_server, tiny_loaded):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    response = httpx.options(f"{tiny_server.url}/chat/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = {**preflight, "Origin": "http://evil.example"}
    response = httpx.options(f"{tiny_server.url}/chat/completions", headers=other)
    assert "access-control-allow-origin" not in response.headers
    with running_server(tiny_loaded) as plain:  # the default: no CORS at all
        response = httpx.get(f"{plain.url}/models", headers={"Origin": "http://localhost:3000"})
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers


# ---- Host header and body size (issue 10, point 15) --------------------------------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "192.168.1.5",
                                  "127.0.0.1.evil.example", "localhost:x"])
def test_foreign_host_headers_are_refused(tiny_server, host):
    response = httpx.get(f"{tiny_server.url}/models", headers={"Host": host})
    assert_error(response, 400, None, "invalid_host")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "127.0.0.2:80",
                                  "[::1]:8000", "app.localhost"])
def test_loopback_host_headers_are_answered(tiny_server, host):
    response = httpx.get(f"{tiny_server.url}/models", headers={"Host": host})
    assert response.status_code == 200


def test_hosts_answered_follow_the_bound_address():
    assert allowed_hosts_for("0.0.0.0") is None and allowed_hosts_for("::") is None
    assert host_allowed("anything.example", allowed_hosts_for("0.0.0.0"))
    lan = allowed_hosts_for("192.168.1.5")
    assert host_allowed("192.168.1.5:8000", lan) and host_allowed("localhost", lan)
    assert not host_allowed("evil.example", lan)
    assert not host_allowed("evil.example", allowed_hosts_for("127.0.0.1"))


def test_a_body_over_the_limit_is_a_413(tiny_loaded):
    with running_server(tiny_loaded, max_body_bytes=64 * 1024) as small:
        big = {"model": MODEL_ID, "prompt": "x " * 40_000, "max_tokens": 2}
        assert_error(post(small, "completions", big), 413, None, "request_too_large")

        def chunked():  # no Content-Length: the count stops it
            yield b'{"model": "gemma-test", "prompt": "'
            for _ in range(100):
                yield b"x" * 1024
            yield b'", "max_tokens": 2}'

        response = httpx.post(f"{small.url}/completions", content=chunked(),
                              headers={"content-type": "application/json"})
        assert_error(response, 413, None, "request_too_large")
        # Under the limit, the same server answers.
        assert post(small, "completions", {"model": MODEL_ID, "prompt": "Hi",
                                           "max_tokens": 2}).status_code == 200
        assert json.loads(httpx.get(f"{small.root}/health").text)["status"] == "ok"


# ---- logit_bias ------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [{"abc": 5}, {"5": 101}, {"5": -200}, {"-3": 1},
                                  {"5": "high"}, {"999999999": 1}])
def test_logit_bias_is_validated(tiny_server, bias):
    assert_error(post(tiny_server, "chat/completions", chat_body(logit_bias=bias)), 400,
                 "logit_bias")


def _reply_ids(server, **extra) -> tuple[int, ...]:
    """The token ids of a greedy 3-token completion (as the engine reported them)."""
    server.client().completions.create(model=MODEL_ID, prompt="Once upon a time",
                                       max_tokens=3, temperature=0, **extra)
    return server.finished[-1].completion_ids


def test_logit_bias_bans_and_forces(tiny_server):
    free = _reply_ids(tiny_server)
    assert _reply_ids(tiny_server)[0] == free[0]  # greedy: the same again
    banned = _reply_ids(tiny_server, logit_bias={str(free[0]): -100})
    assert banned[0] != free[0]
    forced = 818  # any ordinary token
    assert _reply_ids(tiny_server, logit_bias={str(forced): 100}) == (forced,) * 3
    assert _reply_ids(tiny_server, logit_bias={str(forced): 100, "819": 100})[0] in (818, 819)


def test_engine_tracebacks_stay_in_the_log(caplog):
    from app.server.api import _one_line

    message = ("The engine hit an internal error:\nTraceback (most recent call last):\n"
               '  File "engine.py", line 1\nRuntimeError: boom')
    with caplog.at_level("ERROR", logger="ferrox.server"):
        wire = _one_line(message)
    assert "Traceback" not in wire and wire.startswith("The engine hit an internal error")
    assert "RuntimeError: boom" in caplog.text
    assert _one_line("Sampling failed: no token is allowed here") == (
        "Sampling failed: no token is allowed here")


def test_continue_final_message_rules(tiny_server):
    """vLLM's continue_final_message: not with add_generation_prompt, and only onto an
    assistant message; a valid one carries that message on (a reply, no new turn)."""
    both = chat_body(continue_final_message=True, add_generation_prompt=True,
                     messages=user("Hi") + [{"role": "assistant", "content": "Hel"}])
    assert_error(post(tiny_server, "chat/completions", both), 400, "continue_final_message")
    not_assistant = chat_body(continue_final_message=True, add_generation_prompt=False)
    assert_error(post(tiny_server, "chat/completions", not_assistant), 400,
                 "continue_final_message")
    carried = chat_body(continue_final_message=True, add_generation_prompt=False,
                        messages=user("Hi") + [{"role": "assistant", "content": "Hel"}])
    response = post(tiny_server, "chat/completions", carried)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
