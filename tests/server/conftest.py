"""Server fixtures: the real API server on a loopback port, in this process, over a real
engine. `server` runs the embedded model (answers that make sense, for the slow tests);
`tiny_server` a random-weight model of the same shapes and vocabulary (for validation and
wire tests, fast on 2 cores). Both live for the whole session: loading is what costs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from openai import OpenAI

from app.engine.engine import Engine, EngineConfig
from app.engine.events import Finished
from app.engine.runner import EngineRunner
from app.models.loader import LoadedModel
from app.server.api import create_app
from app.server.serve import ApiServer, listen

MODEL_ID = "gemma-test"
KV_TOKENS = 8192  # small KV memory: a request for more must be refused with a 400
# Tests wait for events (a ready line, a request ending), never for a fixed time; this bound
# only ends a hang, and is generous so a loaded machine never trips it.
SAFETY_TIMEOUT_S = 900


@dataclass
class Running:
    port: int
    loaded: LoadedModel
    engine: Engine
    finished: list[Finished]  # every Finished event the engine reported, in order

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.url, api_key="x", max_retries=0, timeout=SAFETY_TIMEOUT_S)

    def wait_idle(self, timeout: float = SAFETY_TIMEOUT_S) -> None:
        """Until the engine has nothing to do (then its thread only sleeps)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_work:
            assert time.monotonic() < deadline, "the engine is still busy"
            time.sleep(0.02)
        time.sleep(0.1)
        assert not self.engine.has_work


@contextmanager
def running_server(loaded: LoadedModel, **app_options) -> Iterator[Running]:
    """The API over `loaded` on a free loopback port until the block ends."""
    engine = Engine(loaded, EngineConfig(kv_tokens=KV_TOKENS))
    runner = EngineRunner(engine)
    finished: list[Finished] = []
    _record_finished(runner, finished)
    api = ApiServer(create_app(runner, loaded, MODEL_ID, **app_options), runner,
                    log_level="warning")
    sock = listen("127.0.0.1", 0)
    thread = threading.Thread(target=api.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SAFETY_TIMEOUT_S
    while not api.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Running(sock.getsockname()[1], loaded, engine, finished)
    finally:
        api.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def _record_finished(runner: EngineRunner, finished: list[Finished]) -> None:
    """Tap the runner so tests can see how each request really ended in the engine."""
    submit = runner.submit

    def tapped(prompt_ids, params, on_event, request_id=None):
        def listen_(event):
            if isinstance(event, Finished):
                finished.append(event)
            on_event(event)
        return submit(prompt_ids, params, listen_, request_id)

    runner.submit = tapped


@pytest.fixture(scope="session")
def embedded_loaded(embedded_model_path) -> LoadedModel:
    from app.engine.device import load_on

    return load_on(embedded_model_path, "cpu", "auto")


@pytest.fixture(scope="session")
def server(embedded_loaded) -> Iterator[Running]:
    with running_server(embedded_loaded) as running:
        yield running


@pytest.fixture(scope="session")
def tiny_loaded(embedded_model_path) -> LoadedModel:
    from app.models.gguf_file import GGUFFile
    from app.models.tokenizer import Tokenizer
    from tests.engine.conftest import make_tiny_model

    with GGUFFile(embedded_model_path) as gguf:
        tokenizer = Tokenizer.from_gguf(gguf)
    return make_tiny_model(tokenizer, context_length=2048)


@pytest.fixture(scope="session")
def tiny_server(tiny_loaded) -> Iterator[Running]:
    with running_server(tiny_loaded, cors_origins=("http://localhost:3000",)) as running:
        yield running


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
