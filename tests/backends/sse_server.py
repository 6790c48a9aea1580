"""A small real HTTP server on loopback that answers with recorded transcripts.

Each route is a function that writes the answer on the live connection: a JSON body, a
server-sent-event stream sent chunk by chunk (optionally cut off or stalled), or nothing at
all. Every request is recorded (path, headers, raw body) for the test to inspect.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STALL_LIMIT_S = 20.0  # the longest a stalled answer waits (bounded even if a test forgets)

Responder = Callable[["_Handler"], None]


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "TranscriptServer"

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        path = self.path.split("?")[0]
        self.server.recorded.append(Recorded(method, path, {k.lower(): v for k, v in self.headers.items()}, body))
        responder = self.server.routes.get((method, path))
        if responder is None:
            json_answer(404, {"detail": "Not Found"})(self)
        else:
            responder(self)

    # -- writing helpers ------------------------------------------------------------------

    def start_chunked(self, status: int = 200, content_type: str = "text/event-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class TranscriptServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes: dict[tuple[str, str], Responder] = {}
        self.recorded: list[Recorded] = []
        self.release = threading.Event()  # ends every stall
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def handle_error(self, request, client_address) -> None:
        pass  # clients hanging up mid-answer (abort, timeouts) is what several tests do

    def route(self, method: str, path: str, responder: Responder) -> None:
        self.routes[(method, path)] = responder

    def posts(self, path: str = "/v1/chat/completions") -> list[Recorded]:
        return [r for r in self.recorded if r.method == "POST" and r.path == path]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


def json_answer(status: int, body, headers: dict[str, str] | None = None) -> Responder:
    def respond(handler: _Handler) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)
    return respond


def sse_answer(events: Sequence[str], *, cut_after: int | None = None,
               stall_after: int | None = None) -> Responder:
    """Send `events` (each a whole SSE event, "data: ...\\n\\n") as separate chunks.
    cut_after=n: after n events, drop the connection mid-body (no closing chunk).
    stall_after=n: after n events, send nothing more until the server is released."""
    def respond(handler: _Handler) -> None:
        handler.start_chunked()
        for n, event in enumerate(events):
            if n == cut_after:
                handler.close_connection = True
                handler.connection.shutdown(2)
                return
            if n == stall_after:
                handler.server.release.wait(STALL_LIMIT_S)
                handler.close_connection = True
                return
            handler.chunk(event.encode())
        handler.end_chunks()
    return respond


def silent_answer(handler: _Handler) -> None:
    """Read the request, then answer nothing until released (a server that hangs)."""
    handler.server.release.wait(STALL_LIMIT_S)
    handler.close_connection = True
