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

from app.engine.session import ModelSession
from app.server import DEFAULT_PORT
from app.server.api import api_model_id, create_app
from app.server.serve import GRACEFUL_SHUTDOWN_S, ApiServer, ServeError, Switchboard, listen

HOST = "127.0.0.1"  # other programs on this computer only; `app serve --host` for more
START_TIMEOUT_S = 30.0
# What a reply cut short by its engine stopping is told (the model switched or unloaded in
# the window, the server turned off, or the app quitting).
STOPPED_WHY = ("Ferrox Chat stopped serving this model (switched, unloaded or the server "
               "turned off)")
NO_MODEL = ("No local model is loaded in Ferrox Chat: pick one of this computer's models in "
            "the app's model picker, then try again.")


class EmbeddedServer:
    """Serves `session`'s model on http://127.0.0.1:`port`/v1 between `start` and `stop`."""

    def __init__(self, session: ModelSession, port: int = DEFAULT_PORT):
        self.session = session
        self.port = port
        self._board = Switchboard(HOST, NO_MODEL, health_status="no_model",
                                  code="model_not_loaded")
        self._server: ApiServer | None = None
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
        server = ApiServer(self._board, log_level="warning")  # the session owns the runner
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
        model_id = api_model_id(loaded)
        self._board.current = create_app(runner, loaded, model_id, bind_host=HOST,
                                         stopped_why=STOPPED_WHY)
        self.model_id = model_id
