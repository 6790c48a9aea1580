"""Run the API server: listen, load a model, start its engine, serve HTTP until stopped.

The port is taken first, so a busy one fails at once; while the model loads, every request
gets a 503 that says so (as llama.cpp's server does), instead of waiting unanswered in the
socket's queue.

Shutdown order (Ctrl+C, SIGTERM, or `should_exit`): stop accepting, abort every generation
in flight so open streams end at once, wait for connections to close, then stop the engine
thread -- all before uvicorn hands a caught signal back to the process.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from starlette.responses import JSONResponse

from app.engine.runner import EngineRunner
from app.server.api import abort_open_requests
from app.server.guards import RequestGuard, allowed_hosts_for
from app.server.schemas import ApiError

GRACEFUL_SHUTDOWN_S = 5.0
LOADING = "The model is still loading; try again in a few seconds."
LOADING_RETRY_AFTER_S = 2


class ServeError(Exception):
    """The server cannot start; the message says why."""


class Switchboard:
    """An ASGI app that hands each request to the API of the model serving now (`current`,
    a `create_app` app), or answers 503 with `waiting` while none does (Host guard first).
    `current` is swapped from a loading thread; a request reads it once, at its start."""

    def __init__(self, host: str, waiting: str, *, health_status: str, code: str,
                 retry_after_s: int | None = None):
        self.current: FastAPI | None = None
        self._waiting, self._health_status, self._code = waiting, health_status, code
        # Retry-After on the 503s: when trying again soon can help (a load under way).
        self._headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
        self._guarded_wait = RequestGuard(self._answer_waiting,
                                          allowed_hosts=allowed_hosts_for(host))

    async def __call__(self, scope, receive, send) -> None:
        app = self.current
        await (app if app is not None else self._guarded_wait)(scope, receive, send)

    async def _answer_waiting(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope.get("path") == "/health":
            body = {"status": self._health_status, "message": self._waiting}
        else:
            body = ApiError(503, self._waiting, code=self._code, kind="server_error").body()
        await JSONResponse(body, status_code=503, headers=self._headers)(scope, receive, send)


def loading_switchboard(host: str) -> Switchboard:
    """What `app serve` answers with until its model is ready."""
    return Switchboard(host, LOADING, health_status="loading", code="model_loading",
                       retry_after_s=LOADING_RETRY_AFTER_S)


class ApiServer(uvicorn.Server):
    """uvicorn's server, stopping the engine's work on shutdown (see the module docstring).
    `app` is one model's API, or a Switchboard whose model comes later (`serve_model`).
    The `runner` it is given is closed after the connections; none: its owner closes it."""

    def __init__(self, app, runner: EngineRunner | None = None, *, log_level: str = "info"):
        super().__init__(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        self._app = app
        self._runner = runner
        self._lock = threading.Lock()  # a model arriving vs. the shutdown beginning
        self._stopping = False

    def serve_model(self, app: FastAPI, runner: EngineRunner) -> bool:
        """From the loading thread: answer with `app` from now on, and close `runner` at
        shutdown. False when the server is already stopping (the caller closes it)."""
        with self._lock:
            if self._stopping or self.should_exit:
                return False
            self._app.current, self._runner = app, runner
            return True

    def _serving(self) -> FastAPI | None:
        return self._app.current if isinstance(self._app, Switchboard) else self._app

    async def shutdown(self, sockets=None) -> None:
        with self._lock:
            self._stopping = True
            app, runner = self._serving(), self._runner
        if app is not None:
            abort_open_requests(app)
        await super().shutdown(sockets)
        if runner is not None:
            await asyncio.to_thread(runner.close)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the (slow) model load so a busy port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ServeError(f"Cannot listen on {host}:{port}: {reason}.") from None


def serve(host: str, port: int, model: str, device: str = "auto", dtype: str = "auto",
          data_dir: str | None = None, kv_dir: str | None = None,
          cors_origins: tuple[str, ...] = ()) -> None:
    """Serve `model` ('default' or a .gguf path) on http://host:port/v1 until stopped.
    Requests whose Host is not a loopback name (or `host`) are refused; `cors_origins`
    lets those browser origins call the API. A model that fails to load stops the server
    and its error is raised here."""
    from app.cli import resolve_model_path

    sock = listen(host, port)  # first: a busy port fails before anything else
    try:
        path = resolve_model_path(model, data_dir)
    except BaseException:
        sock.close()
        raise
    shown_host = f"[{host}]" if ":" in host else host  # an IPv6 address, as URLs write it
    url = f"http://{shown_host}:{sock.getsockname()[1]}/v1"
    server = ApiServer(loading_switchboard(host))
    failure: list[BaseException] = []

    def load() -> None:
        try:
            _load_and_serve(server, path, device, dtype, kv_dir, host, cors_origins, url)
        except BaseException as exc:  # raised below, once the server has stopped
            failure.append(exc)
            server.should_exit = True

    print(f"Loading {path.name}; {url} answers 503 until it is ready", flush=True)
    # Torch work on a thread that ends with it, so the engine thread's OpenMP helpers keep
    # spinning (app/openmp.py).
    loader = threading.Thread(target=load, name="ferrox-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl+C: uvicorn shut down cleanly, then re-raised it
        pass
    finally:
        sock.close()
        # A load cannot be cut short, and a process leaving while torch works on another
        # thread aborts ("terminate called..."): let it end (it then closes what it built).
        if loader.is_alive():
            print("Stopping once the model has finished loading...", flush=True)
            loader.join()
    if failure:
        raise failure[0]


def _load_and_serve(server: ApiServer, path: Path, device: str, dtype: str,
                    kv_dir: str | None, host: str, cors_origins: tuple[str, ...],
                    url: str) -> None:
    from app.engine.device import load_on
    from app.engine.engine import Engine
    from app.server.api import api_model_id, create_app

    loaded = load_on(path, device, dtype)
    store = None
    if kv_dir is not None:  # the prefix cache on disk, shared with the app if pointed there
        from app.engine.engine import EngineConfig
        from app.engine.kv_disk import open_store

        store = open_store(Path(kv_dir), loaded, EngineConfig().page_size)
    runner = EngineRunner(Engine(loaded, kv_store=store))
    model_id = api_model_id(loaded)
    app = create_app(runner, loaded, model_id, bind_host=host, cors_origins=cors_origins)
    if not server.serve_model(app, runner):  # stopped (Ctrl+C) while it loaded
        runner.close()
        return
    print(f"Serving {model_id} on {loaded.device} at {url} (Ctrl+C to stop)", flush=True)
