"""The API server inside the desktop app: other programs on this computer use the model the
window has loaded, through the same engine as the chats.

`EmbeddedServer` listens on a loopback port (127.0.0.1 only; the Host guard of `create_app`
applies) from a thread of its own, and follows a `ModelSession`: while a local model runs,
requests go to `create_app` over that session's runner, so API requests and the window's
chats are scheduled together, fairly, by one engine, with one copy of the weights; while
none runs (none loaded yet, or a load in progress) every request gets a 503 that says so.
A model switch aborts the API's open generations with the old engine (the
session closes its runner) and later requests reach the new model under its own name.

Nothing here knows Qt: the window's bridge starts and stops it (app/ui/bridge.py).
"""

from __future__ import annotations

import threading
import time

import uvicorn
from starlette.responses import JSONResponse

from app.engine.session import ModelSession
from app.server import DEFAULT_PORT
from app.server.api import abort_open_requests, create_app
from app.server.guards import RequestGuard, allowed_hosts_for
from app.server.schemas import ApiError
from app.server.serve import GRACEFUL_SHUTDOWN_S, ServeError, listen

HOST = "127.0.0.1"  # other programs on this computer only; `app serve --host` for more
START_TIMEOUT_S = 30.0
# What a reply cut short by its engine stopping is told (the model switched or unloaded in
# the window, the server turned off, or the app quitting).
STOPPED_WHY = ("Ferrox Chat stopped serving this model (switched, unloaded or the server "
               "turned off)")
NO_MODEL = ("No local model is loaded in Ferrox Chat: pick one of this computer's models in "
            "the app's model picker, then try again.")


class _Switchboard:
    """The ASGI app uvicorn runs: hands each request to the app of the model that serves
    now, or answers 503 while none does. `current` is swapped from the session's loading
    thread; a request reads it once, at its start."""

    def __init__(self, host: str):
        self.current = None
        self._no_model = RequestGuard(_answer_no_model, allowed_hosts=allowed_hosts_for(host))

    async def __call__(self, scope, receive, send) -> None:
        app = self.current
        await (app if app is not None else self._no_model)(scope, receive, send)


async def _answer_no_model(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    if scope.get("path") == "/health":
        body = {"status": "no_model", "message": NO_MODEL}
    else:
        body = ApiError(503, NO_MODEL, code="model_not_loaded", kind="server_error").body()
    await JSONResponse(body, status_code=503)(scope, receive, send)


class _Uvicorn(uvicorn.Server):
    """uvicorn, ending the open generations first when it stops (they would otherwise hold
    the graceful shutdown for its whole timeout). The session owns the runner: it stays."""

    def __init__(self, board: _Switchboard):
        super().__init__(uvicorn.Config(board, log_level="warning", lifespan="off",
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        self._board = board

    async def shutdown(self, sockets=None) -> None:
        app = self._board.current
        if app is not None:
            abort_open_requests(app)
        await super().shutdown(sockets)


class EmbeddedServer:
    """Serves `session`'s model on http://127.0.0.1:`port`/v1 between `start` and `stop`."""

    def __init__(self, session: ModelSession, port: int = DEFAULT_PORT):
        self.session = session
        self.port = port
        self._board = _Switchboard(HOST)
        self._server: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self.model_id: str | None = None  # the name clients use for the model serving now

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Listen and serve (returns once it does). Raises ServeError when the port cannot
        be had (taken by another program, not allowed) or the server does not come up."""
        if self.running:
            return
        sock = listen(HOST, self.port)
        self.port = sock.getsockname()[1]  # port 0: the free one the system picked
        server = _Uvicorn(self._board)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="ferrox-api", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                thread.join(GRACEFUL_SHUTDOWN_S)
                sock.close()
                raise ServeError(f"The API server did not start on port {self.port}.")
            time.sleep(0.01)
        self._server, self._thread, self._socket = server, thread, sock
        self.session.watch(self._follow)

    def stop(self) -> None:
        """Stop listening; open generations end at once (the model stays loaded)."""
        self.session.unwatch(self._follow)
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None and thread is not None:
            server.should_exit = True
            thread.join(GRACEFUL_SHUTDOWN_S + 5)
            self._socket.close()
        self._board.current = None
        self.model_id = None

    def _follow(self, serving) -> None:
        """The session's watcher: (loaded, runner) now serves, or None (stopping)."""
        if serving is None:
            self._board.current, self.model_id = None, None
            return
        loaded, runner = serving
        model_id = loaded.path.stem
        self._board.current = create_app(runner, loaded, model_id, bind_host=HOST,
                                         stopped_why=STOPPED_WHY)
        self.model_id = model_id
