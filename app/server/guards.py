"""What every HTTP request passes before the API sees it: the Host header and the body size.

- Host: a web page can point its own domain at 127.0.0.1 (DNS rebinding) and then talk to a
  local server as if it were same-origin; the browser still sends the page's domain as Host.
  So only loopback names are answered, unless the server was asked to listen on another
  address (that address is answered too; a wildcard bind, 0.0.0.0 or ::, answers any name,
  since a LAN server cannot know every name it is reached by).
- Body: read here, up to `max_body_bytes`, before the app parses anything; a bigger body is a
  413 at once (by its Content-Length, or when the count passes the limit), so one huge
  request cannot hold the event loop while it is parsed.

Both answer in OpenAI's error shape. Pure ASGI, so streaming responses pass untouched.
"""

from __future__ import annotations

import ipaddress
import json

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # a 1M-token prompt as text or as token ids fits

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


def allowed_hosts_for(bind_host: str) -> frozenset[str] | None:
    """The Host names answered when listening on `bind_host`: None = any (wildcard bind);
    else loopback names are always allowed (see `host_allowed`) plus the bound address."""
    host = bind_host.strip().lower().strip("[]")
    if host in _WILDCARDS:
        return None
    return frozenset({host})


def host_allowed(header: str | None, allowed: frozenset[str] | None) -> bool:
    if allowed is None or header is None:  # HTTP/1.0 without Host: no browser sends that
        return True
    name = _host_name(header)
    return name is not None and (_is_loopback(name) or name in allowed)


def _host_name(header: str) -> str | None:
    """'Example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'; None if malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[1:end] if end > 0 else None
    name, _, port = header.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".")


def _is_loopback(name: str) -> bool:
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class RequestGuard:
    """ASGI middleware: checks Host, then reads the whole body (bounded) and replays it."""

    def __init__(self, app, *, allowed_hosts: frozenset[str] | None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        host = headers.get("host")
        if not host_allowed(host, self.allowed_hosts):
            await _error(send, 400, f"The Host header {host!r} is not a name this server "
                                    "answers to: it serves loopback names (localhost, "
                                    "127.0.0.1, [::1]) only, unless started with --host "
                                    "another address.", "invalid_host")
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as before

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        limit = self.max_body_bytes
        await _error(send, 413, f"The request body is larger than this server's limit of "
                                f"{limit:,} bytes ({limit // (1024 * 1024)} MiB).",
                     "request_too_large")


async def _error(send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
