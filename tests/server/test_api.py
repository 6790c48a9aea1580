"""The API server as a client sees it: the official `openai` client (and raw httpx where a
client would hide the wire) against the real server on a loopback port, with the embedded
model loaded once for the module. Replies stay short (max_tokens <= 16) for the 2-core CI.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from openai import OpenAI

from app.models.chat_template import Message, encode_chat
from app.server.serve import listen
from tests.server.conftest import KV_TOKENS, MODEL_ID, SAFETY_TIMEOUT_S, user

pytestmark = pytest.mark.slow

STORY = ("The lighthouse keeper of Grey Island kept a logbook for forty years. Every night "
         "he wrote down the weather, the ships that passed, the birds that rested on the "
         "rail and the colour of the sea at dusk. When he retired, the village asked him "
         "what he had learned. He said that the sea is never the same twice, that fog "
         "arrives on quiet feet, and that a lamp is only as good as the person who trims "
         "its wick. The new keeper read the whole logbook in one winter and began her own.")

# ---- models and plain requests ---------------------------------------------------------


def test_lists_the_loaded_model(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert server.client().models.retrieve(MODEL_ID).id == MODEL_ID


def test_chat_completion_greedy(server):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    reply = server.client().chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=8, temperature=0)
    assert reply.object == "chat.completion" and reply.model == MODEL_ID
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    expected_prompt = encode_chat(server.loaded.tokenizer, server.loaded.template,
                                  [Message("system", "Answer briefly."),
                                   Message("user", "Name a colour.")])
    usage = reply.usage
    assert usage.prompt_tokens == len(expected_prompt)
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # shorter than one cache page
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 8


def test_text_completion_from_text_and_from_token_ids(server):
    client = server.client()
    by_text = client.completions.create(model=MODEL_ID, prompt="Once upon a time",
                                        max_tokens=8, temperature=0, logprobs=2)
    assert by_text.object == "text_completion"
    choice = by_text.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert by_text.usage.completion_tokens == 8
    tok = server.loaded.tokenizer
    ids = [tok.bos_id] + tok.encode("Once upon a time")
    assert by_text.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert "".join(logprobs.tokens) == choice.text
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # Greedy: the chosen token is the most likely one.
    assert all(lp == pytest.approx(max(top.values())) for lp, top
               in zip(logprobs.token_logprobs, logprobs.top_logprobs))

    by_ids = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == choice.text


def test_chat_logprobs(server):
    reply = server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Hello!"), max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token  # greedy
        assert bytes(entry.bytes) == entry.token.encode()


# ---- streaming -------------------------------------------------------------------------


def _stream_chat(client: OpenAI, messages: list[dict], **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=messages,
                                                 stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_streamed_chat_is_shaped_like_openai(server):
    text, chunks = _stream_chat(server.client(), user("Hi there!"), max_tokens=6,
                                temperature=0, stream_options={"include_usage": True})
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last_choice, usage_chunk = chunks
    assert all(c.choices[0].finish_reason is None for c in body)
    assert last_choice.choices[0].finish_reason in ("stop", "length")
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens <= 6
    assert all(c.usage is None for c in chunks[:-1])
    same = server.client().chat.completions.create(model=MODEL_ID, messages=user("Hi there!"),
                                                   max_tokens=6, temperature=0)
    assert text == same.choices[0].message.content


def test_streamed_completion_without_usage_option(server):
    chunks = list(server.client().completions.create(
        model=MODEL_ID, prompt="The sky is", max_tokens=5, temperature=0, stream=True))
    assert all(c.object == "text_completion" and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)


def test_two_chats_stream_at_once(server):
    prompts = ["Hi there!", "Tell me a story about a cat."]
    results: dict[int, tuple[str, list]] = {}
    start = threading.Barrier(len(prompts))

    def chat(i: int) -> None:
        start.wait()
        results[i] = _stream_chat(server.client(), user(prompts[i]), max_tokens=12,
                                  temperature=0)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SAFETY_TIMEOUT_S)
    assert sorted(results) == [0, 1]
    for text, chunks in results.values():
        assert text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


# ---- the prefix cache across turns -----------------------------------------------------


def _conversation(topic: str) -> list[dict]:
    return [{"role": "system", "content": f"({topic}) {STORY}"},  # no shared page
            {"role": "user", "content": "What did the keeper write down every night?"}]


def _assert_reused_turn_one(first_prompt_tokens: int, usage) -> None:
    cached = usage.prompt_tokens_details.cached_tokens
    assert usage.prompt_tokens > first_prompt_tokens
    # Whole cache pages of turn one are adopted; allow the last two pages to differ.
    assert first_prompt_tokens - 32 <= cached < usage.prompt_tokens


def test_follow_up_turn_reports_cached_tokens(server):
    client = server.client()
    turn_one = _conversation("plain")
    first = client.chat.completions.create(model=MODEL_ID, messages=turn_one, max_tokens=8,
                                           temperature=0)
    assert first.usage.prompt_tokens > 100
    turn_two = turn_one + [{"role": "assistant", "content": first.choices[0].message.content},
                           {"role": "user", "content": "And what did he learn?"}]
    second = client.chat.completions.create(model=MODEL_ID, messages=turn_two, max_tokens=8,
                                            temperature=0)
    _assert_reused_turn_one(first.usage.prompt_tokens, second.usage)


def test_follow_up_turn_reports_cached_tokens_when_streaming(server):
    client = server.client()
    turn_one = _conversation("streamed")
    text, chunks = _stream_chat(client, turn_one, max_tokens=8, temperature=0,
                                stream_options={"include_usage": True})
    first_usage = chunks[-1].usage
    assert first_usage.prompt_tokens_details.cached_tokens == 0  # a new conversation
    turn_two = turn_one + [{"role": "assistant", "content": text},
                           {"role": "user", "content": "And what did he learn?"}]
    _, chunks = _stream_chat(client, turn_two, max_tokens=8, temperature=0,
                             stream_options={"include_usage": True})
    _assert_reused_turn_one(first_usage.prompt_tokens, chunks[-1].usage)


# ---- sampling controls -----------------------------------------------------------------


def test_stop_strings_end_the_reply_before_the_stop(server):
    client = server.client()
    prompt = "Once upon a time"
    free = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12,
                                     temperature=0).choices[0].text
    stop = next(word for word in free.split()[2:] if len(word) >= 4)  # well inside the reply
    cut = free[: free.index(stop)]
    for stops in (stop, ["@@never@@", stop]):
        stopped = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12,
                                            temperature=0, stop=stops).choices[0]
        assert stopped.finish_reason == "stop" and stopped.text == cut
    text, chunks = _stream_chat(client, user("Count: one, two, three, four"), max_tokens=12,
                                temperature=0, stop=[","])
    assert "," not in text and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_same_seed_gives_the_same_text(server):
    client = server.client()

    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model=MODEL_ID, messages=user("Write a line of a poem."), max_tokens=12,
            temperature=0.8, seed=seed).choices[0].message.content

    assert sample(1234) == sample(1234)


# ---- errors ----------------------------------------------------------------------------


def test_prompt_longer_than_the_context_is_a_400(server):
    context = server.loaded.context_length
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL_ID, prompt=[818] * (context + 10),
                                           max_tokens=4)
    assert caught.value.status_code == 400
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["message"].startswith(  # vLLM's words, which client libraries look for
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{context + 14} tokens ({context + 10} in the messages, 4 in the completion).")


def test_max_tokens_beyond_the_context_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=MODEL_ID, messages=user("Hi"),
                                                max_tokens=server.loaded.context_length)
    assert caught.value.body["param"] == "max_tokens"
    assert caught.value.code == "context_length_exceeded"
    assert f"maximum context length is {server.loaded.context_length} tokens" in (
        caught.value.message)


def test_request_beyond_the_kv_memory_is_refused_with_a_400(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL_ID, prompt="Hi", max_tokens=KV_TOKENS + 1,
                                           stream=True)
    assert "KV memory" in caught.value.message


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
])
def test_invalid_parameters_are_a_400(server, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=MODEL_ID, messages=user("Hi"),
                                                max_tokens=2, **extra)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type"),
    ("chat/completions", {"messages": []}, "messages"),
    ("completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("completions", {"prompt": ["one", "two"]}, "prompt"),
    ("completions", {"prompt": "x", "echo": True}, "echo"),
])
def test_errors_are_shaped_like_openai(server, path, body, param):
    response = httpx.post(f"{server.url}/{path}", json={"model": MODEL_ID, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_malformed_json_and_unknown_routes(server):
    response = httpx.post(f"{server.url}/completions", content=b"{nope",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "The request body is not valid JSON."
    response = httpx.get(f"{server.url}/nowhere")
    assert response.status_code == 404 and "error" in response.json()


# ---- the client going away -------------------------------------------------------------


def test_client_disconnecting_mid_stream_aborts_the_request(server):
    seen = len(server.finished)
    body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/completions", json=body,
                      timeout=SAFETY_TIMEOUT_S) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]
    # Leaving the block closed the connection mid-reply.
    deadline = time.monotonic() + SAFETY_TIMEOUT_S
    while len(server.finished) == seen:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.02)
    ended = server.finished[seen]
    assert ended.finish_reason == "abort" and ended.usage.completion_tokens < 200
    server.wait_idle()
    server.engine.check_integrity()


def test_client_giving_up_on_a_plain_request_aborts_it(server):
    seen = len(server.finished)
    body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    deadline = time.monotonic() + SAFETY_TIMEOUT_S
    while len(server.finished) == seen:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.02)
    ended = server.finished[seen]
    assert ended.finish_reason == "abort" and ended.usage.completion_tokens < 200
    server.wait_idle()
    server.engine.check_integrity()


# ---- the `serve` command ---------------------------------------------------------------


def _start_cli_server(model_path, port: int, data_dir, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, FERROX_DATA_DIR=str(data_dir))
    return subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--port", str(port), "--model", str(model_path),
         "--device", "cpu", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@dataclass
class _StdoutLines:
    """A process's stdout read line by line on a thread: `lines` so far, and `next_line()` to
    wait for the next one (None once the process closed its stdout)."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def next_line(self) -> str | None:
        try:
            return self._queue.get(timeout=SAFETY_TIMEOUT_S)
        except queue.Empty:
            pytest.fail(f"no output from the server in {SAFETY_TIMEOUT_S} s")

    def join(self) -> str:
        self._thread.join(SAFETY_TIMEOUT_S)
        return "".join(self.lines)


def _wait_until_serving(proc: subprocess.Popen, stdout: _StdoutLines, url: str) -> dict:
    """Waits for the "Serving ... at <url>" line the command prints once the model is loaded
    and its socket listens -- however long loading takes -- then asks for the model list."""
    while True:
        line = stdout.next_line()
        assert line is not None, f"the server exited before serving: {proc.communicate()[1]}"
        if line.startswith("Serving ") and url in line:
            return httpx.get(f"{url}/models", timeout=SAFETY_TIMEOUT_S).json()


def _free_port() -> int:
    with listen("127.0.0.1", 0) as sock:
        return sock.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_command_answers_and_stops_on_a_signal(embedded_model_path, tmp_path, sig):
    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1"
    origin = "http://localhost:5173"
    proc = _start_cli_server(embedded_model_path, port, tmp_path, "--cors-origin", origin)
    stdout = _StdoutLines(proc)
    try:
        models = _wait_until_serving(proc, stdout, url)
        assert [m["id"] for m in models["data"]] == [embedded_model_path.stem]
        # --cors-origin lets that origin's pages call the API (and only that one).
        allowed = httpx.options(f"{url}/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert allowed.headers.get("access-control-allow-origin") == origin
        assert httpx.get(f"{url}/models", headers={"Host": "evil.example"}).status_code == 400
        # A reply in flight when the signal arrives is stopped, not waited for.
        body = {"model": embedded_model_path.stem, "prompt": "Once upon a time", "max_tokens": 2000,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/completions", json=body,
                          timeout=SAFETY_TIMEOUT_S) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(sig)
            rest = [line for line in lines if line.startswith("data: ")]
        assert "server_shutting_down" in rest[-1]
        proc.wait(SAFETY_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = stdout.join()
    stderr = proc.stderr.read()
    # uvicorn re-raises SIGTERM once it has shut down cleanly; Ctrl+C exits normally.
    assert proc.returncode in (0, -signal.SIGTERM), stderr
    assert f"http://127.0.0.1:{port}/v1" in output
    assert "Traceback" not in stderr


def test_serve_command_fails_fast_on_a_busy_port(server, tmp_path):
    proc = _start_cli_server("/nonexistent.gguf", server.port, tmp_path)
    _, stderr = proc.communicate(timeout=SAFETY_TIMEOUT_S)
    assert proc.returncode == 1
    assert stderr.strip().splitlines() == [
        f"error: Cannot listen on 127.0.0.1:{server.port}: Address already in use."]
