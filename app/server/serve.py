"""Run the API server: load a model, start its engine, serve HTTP until stopped.

Shutdown order (Ctrl+C, SIGTERM, or `should_exit`): stop accepting, abort every generation
in flight so open streams end at once, wait for connections to close, then stop the engine
thread -- all before uvicorn hands a caught signal back to the process.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from app.engine.runner import EngineRunner
from app.server.api import abort_open_requests

GRACEFUL_SHUTDOWN_S = 5.0


class ServeError(Exception):
    """The server cannot start; the message says why."""


class ApiServer(uvicorn.Server):
    """uvicorn's server, stopping the engine's work on shutdown (see the module docstring)."""

    def __init__(self, app: FastAPI, runner: EngineRunner, *, log_level: str = "info"):
        super().__init__(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        self._app = app
        self._runner = runner

    async def shutdown(self, sockets=None) -> None:
        abort_open_requests(self._app)
        await super().shutdown(sockets)
        await asyncio.to_thread(self._runner.close)


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
    lets those browser origins call the API."""
    from app.cli import resolve_model_path
    from app.engine.device import load_on
    from app.engine.engine import Engine
    from app.openmp import run_on_passing_thread
    from app.server.api import create_app

    sock = listen(host, port)
    try:
        # Torch work on threads that end with it, so the engine thread's OpenMP helpers
        # keep spinning (app/openmp.py).
        loaded = run_on_passing_thread(load_on, resolve_model_path(model, data_dir), device, dtype)
        store = None
        if kv_dir is not None:  # the prefix cache on disk, shared with the app if pointed there
            from app.engine.engine import EngineConfig
            from app.engine.kv_disk import open_store

            store = open_store(Path(kv_dir), loaded, EngineConfig().page_size)
        runner = EngineRunner(run_on_passing_thread(Engine, loaded, kv_store=store))
    except BaseException:
        sock.close()
        raise
    model_id = loaded.path.stem
    app = create_app(runner, loaded, model_id, bind_host=host, cors_origins=cors_origins)
    server = ApiServer(app, runner)
    bound_port = sock.getsockname()[1]
    print(f"Serving {model_id} on {loaded.device} at http://{host}:{bound_port}/v1 "
          "(Ctrl+C to stop)", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl+C: uvicorn shut down cleanly, then re-raised it
        pass
    finally:
        runner.close()
        sock.close()
