"""RemoteBackend against the project's own OpenAI-compatible server (`python -m app serve`),
started as a process on loopback with the embedded model."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading

import pytest

from app.backends.remote import RemoteBackend, RemoteSettings
from app.engine.events import Finished, Token
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message
from app.models.model_facts import read_model_facts
from tests.backends.helpers import Collector

SAFETY_TIMEOUT_S = 900  # only ends a hang; loading takes what it takes


def _serving_url(proc: subprocess.Popen) -> str:
    """Waits for "Serving ... at http://127.0.0.1:PORT/v1" (printed once the model is loaded)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    while True:
        line = lines.get(timeout=SAFETY_TIMEOUT_S)
        assert line is not None, f"the server exited before serving: {proc.stderr.read()}"
        found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
        if line.startswith("Serving ") and found:
            return found.group(1)


@pytest.mark.slow
def test_remote_backend_on_our_own_server(embedded_model_path, tmp_path):
    env = dict(os.environ, FERROX_DATA_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", str(embedded_model_path),
                             "--port", "0", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = _serving_url(proc)
        backend = RemoteBackend(RemoteSettings(url))
        model = backend.load(embedded_model_path.stem)
        assert model.location.startswith("127.0.0.1:")
        assert model.context_length == read_model_facts(embedded_model_path).context_length

        greedy = SamplingParams(max_tokens=12, temperature=0)
        history = [Message("user", "Name three colours.")]
        first = Collector()
        backend.submit_chat(history, greedy, first, session_id="chat-1")
        end = first.wait()
        assert isinstance(end, Finished) and end.text == first.text and end.text
        assert all(isinstance(e, Token) and e.token_id is None for e in first.events[:-1])
        assert end.usage.completion_tokens >= 1 and end.usage.prompt_tokens > 5

        history += [Message("assistant", end.text), Message("user", "And three more.")]
        second = Collector()
        backend.submit_chat(history, greedy, second, session_id="chat-1")
        again = second.wait()
        assert isinstance(again, Finished)
        assert again.usage.cached_tokens > 0  # turn 1's prompt came from the server's prefix cache

        # Continue: a reply cut by the length limit is carried on by the server (the chat
        # API with continue_final_message), and together the parts are the uncut reply.
        whole, cut, rest = Collector(), Collector(), Collector()
        question = [Message("user", "Count from one to twenty in words.")]
        backend.submit_chat(question, SamplingParams(max_tokens=16, temperature=0), whole)
        backend.submit_chat(question, SamplingParams(max_tokens=8, temperature=0), cut)
        assert whole.wait().finish_reason == "length" and cut.wait().finish_reason == "length"
        backend.submit_chat(question, SamplingParams(max_tokens=8, temperature=0), rest,
                            partial=cut.text)
        assert isinstance(rest.wait(), Finished) and rest.text
        assert cut.text + rest.text == whole.text

        # Stopped at once (before the reply could end by itself): the stream is closed.
        stopped = Collector()
        request_id = backend.submit_chat(history, SamplingParams(max_tokens=2000, temperature=0),
                                         stopped)
        backend.abort(request_id)
        assert stopped.wait().finish_reason == "abort"
        backend.close()

        cli = subprocess.run([sys.executable, "-m", "app", "generate", "--chat", "--base-url", url,
                              "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0", "--json"],
                             capture_output=True, text=True, env=env, timeout=SAFETY_TIMEOUT_S)
        assert cli.returncode == 0, cli.stderr
        out = json.loads(cli.stdout)
        assert out["model"] == embedded_model_path.stem and out["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)
