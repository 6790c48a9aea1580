"""What went wrong talking to a remote server, in one sentence a person can act on.

Two sources: an httpx exception (nothing usable came back: refused, unknown name, TLS, timeout,
connection cut) and an HTTP error status with whatever body the server sent. Servers word
their error bodies differently; `error_detail` reads all the shapes we know:

    OpenAI, llama.cpp, Ollama, vLLM >= 0.6:  {"error": {"message": "...", "type": ..., "code": ...}}
    vLLM/SGLang (older), FastAPI:            {"object": "error", "message": "..."} / {"detail": "..."}
    vLLM/SGLang --api-key middleware:        {"error": "Unauthorized"}
"""

from __future__ import annotations

import email.utils
import errno
import json
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

MAX_DETAIL_CHARS = 300  # an HTML error page is cut, not shown whole


@dataclass(frozen=True)
class RemoteFailure:
    message: str
    retry_after: float | None = None


def where(url: str) -> str:
    """host:port of a URL, for messages."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def describe_exception(exc: BaseException, url: str, *, timeout_s: float,
                       mid_reply: bool = False) -> RemoteFailure:
    """The failure an httpx (or socket) exception stands for."""
    place = where(url)
    if isinstance(exc, httpx.TimeoutException):
        if isinstance(exc, httpx.ConnectTimeout):
            return RemoteFailure(f"Connecting to {place} timed out after {timeout_s:g} s. Check the "
                                 "address, and that no firewall is in the way.")
        return RemoteFailure(f"The server at {place} stopped answering for {timeout_s:g} s, so the "
                             "request was given up" + ("; the text so far is kept." if mid_reply else
                                                       ". It may be overloaded; try again."))
    if isinstance(exc, httpx.ConnectError):
        return RemoteFailure(_connect_failure(exc, place, urlsplit(url).hostname or place))
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)) or mid_reply:
        if mid_reply:
            return RemoteFailure(f"The connection to {place} was cut in the middle of the reply; "
                                 "the text so far is kept.")
        return RemoteFailure(f"The server at {place} closed the connection without answering "
                             f"({_reason(exc)}).")
    if isinstance(exc, httpx.HTTPError):
        return RemoteFailure(f"Talking to {place} failed: {_reason(exc)}.")
    return RemoteFailure(f"Talking to {place} failed unexpectedly: {type(exc).__name__}: {exc}")


def _connect_failure(exc: BaseException, place: str, host: str) -> str:
    cause = _root_cause(exc)
    text = str(exc)
    if isinstance(cause, ssl.SSLError) or "SSL" in text or "CERTIFICATE" in text.upper():
        return (f"A secure (TLS) connection to {place} could not be made ({_reason(cause)}). "
                "Check whether the server speaks https or plain http, and its certificate.")
    if isinstance(cause, socket.gaierror) or "Name or service not known" in text \
            or "nodename nor servname" in text or "getaddrinfo" in text:
        return f"The server name {host!r} could not be found (DNS). Check the base URL."
    if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED \
            or "refused" in text.lower():
        return (f"Nothing is answering at {place} (connection refused). Is the server running, "
                "and is the port right?")
    return f"Could not connect to {place}: {_reason(exc)}."


def _root_cause(exc: BaseException) -> BaseException:
    seen = 0
    while seen < 10 and (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return exc


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text[:MAX_DETAIL_CHARS] if text else type(exc).__name__


def describe_status(status: int, body: bytes, headers: httpx.Headers, url: str,
                    model: str | None) -> RemoteFailure:
    """The failure an HTTP error answer stands for."""
    place = where(url)
    detail = error_detail(body)
    said = f": {detail}" if detail else "."
    retry_after = parse_retry_after(headers.get("retry-after"))
    if status in (401, 403):
        return RemoteFailure(f"The server at {place} refused the API key ({status}){said} Check the "
                             "connection's API key.")
    if status == 404:
        return RemoteFailure(f"The server at {place} has no model {model!r} or no such endpoint "
                             f"(404){said} Pick a model from the server's list, and check that "
                             "the base URL ends in /v1.")
    if status == 429:
        wait = f" Try again in {retry_after:g} s." if retry_after is not None else " Try again later."
        return RemoteFailure(f"The server at {place} is busy or rate-limited (429){said}{wait}",
                             retry_after)
    if status >= 500:
        wait = f" Try again in {retry_after:g} s." if retry_after is not None else ""
        return RemoteFailure(f"The server at {place} failed ({status} {_phrase(status)}){said}{wait}",
                             retry_after)
    return RemoteFailure(f"The server at {place} refused the request ({status} {_phrase(status)}){said}",
                         retry_after)


def _phrase(status: int) -> str:
    try:
        return httpx.codes.get_reason_phrase(status)
    except Exception:  # noqa: BLE001 -- an unknown code has no phrase
        return ""


def error_detail(body: bytes) -> str:
    """The server's own words about an error, from any of the body shapes above."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return _clip(text)
    return _clip(detail_of(data) or text)


def detail_of(data) -> str:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        for key in ("message", "detail"):
            if isinstance(data.get(key), str):
                return data[key]
    return ""


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS - 1] + "…"


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds: either a number of seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, round(when.timestamp() - (time.time() if now is None else now), 1))
