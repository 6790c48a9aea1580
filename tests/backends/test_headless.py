"""`generate --chat --base-url ...`: the CLI runs RemoteBackend and prints the local JSON shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from app.cli import build_parser, run_command
from tests.backends import transcripts as t
from tests.backends.sse_server import TranscriptServer, json_answer, sse_answer

LOCAL_JSON_KEYS = {"model", "device", "dtype", "prompt_ids", "completion_ids", "text",
                   "finish_reason", "logprobs", "usage", "timings"}  # tests/test_cli.py's contract


@pytest.fixture
def server():
    with TranscriptServer() as srv:
        srv.route("GET", "/v1/models", json_answer(200, t.VLLM_MODELS))
        srv.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream()))
        yield srv


def cli(*argv: str) -> int:
    return run_command(build_parser().parse_args(["generate", *argv]))


def test_remote_generate_json_has_the_local_shape(server, capsys, monkeypatch):
    monkeypatch.setenv("BOX_KEY", "sk-box")
    code = cli("--chat", "--base-url", server.base_url, "--remote-model", t.VLLM_MODEL,
               "--api-key-env", "BOX_KEY", "--prompt", "Say hello.", "--max-tokens", "16", "--json")
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out)
    assert set(result) == LOCAL_JSON_KEYS
    assert result["text"] == "Hello there!" and result["finish_reason"] == "stop"
    assert result["usage"] == {"prompt_tokens": 1200, "cached_tokens": 1184, "completion_tokens": 3}
    assert set(result["timings"]) == {"load_s", "prefill_s", "decode_tokens_per_s"}
    assert result["model"] == t.VLLM_MODEL and result["dtype"] == "remote"
    request = server.posts()[-1]
    assert request.headers["authorization"] == "Bearer sk-box" and request.headers["x-session-id"]
    assert request.json()["messages"] == [{"role": "user", "content": "Say hello."}]
    assert request.json()["max_tokens"] == 16


def test_remote_generate_streams_text_and_picks_the_only_model(server, capsys):
    assert cli("--chat", "--base-url", server.base_url, "--prompt", "hi") == 0
    assert capsys.readouterr().out == "Hello there!\n"


@pytest.mark.parametrize("argv, message", [
    (["--base-url", "http://127.0.0.1:9/v1", "--prompt", "hi"], "give --prompt text with --chat"),
    (["--chat", "--base-url", "ftp://box", "--prompt", "hi"], "must start with http:// or https://"),
    (["--chat", "--base-url", "http://127.0.0.1:9/v1", "--api-key-env", "NO_SUCH_VAR_42",
      "--prompt", "hi"], "NO_SUCH_VAR_42, but that environment variable is not set"),
    (["--chat", "--remote-model", "m", "--prompt", "hi"], "go with --base-url"),
])
def test_remote_generate_refusals(capsys, argv, message):
    assert cli(*argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_remote_generate_failure_is_one_line_and_exit_1(server, capsys):
    server.route("POST", "/v1/chat/completions", json_answer(429, t.RATE_LIMITED, {"Retry-After": "3"}))
    assert cli("--chat", "--base-url", server.base_url, "--prompt", "hi", "--json") == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (f"error: The server at 127.0.0.1:{server.server_address[1]} is busy or "
                       "rate-limited (429): Rate limit reached for requests Try again in 3 s.\n")


def test_remote_generate_as_a_user_runs_it(server):
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "app", "generate", "--chat", "--base-url", server.base_url,
                           "--remote-model", t.VLLM_MODEL, "--prompt", "hi", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["usage"]["cached_tokens"] == 1184
