"""A server's base URL, checked and put in one spelling (shared by the backend and the
connections store, which must agree on it)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


class BaseUrlError(ValueError):
    """The text is not a usable base URL; the message says what to write instead."""


def normalize_base_url(text: str) -> str:
    """`http(s)://host[:port]/path` with no trailing slash; a bare `http://host:port` gets
    `/v1`, the path every OpenAI-compatible server (vLLM, SGLang, llama.cpp, Ollama) uses.
    Credentials and query strings are refused: the API key has its own, safer place."""
    raw = (text or "").strip()
    example = "for example http://gpu-box:8000/v1"
    if not raw:
        raise BaseUrlError(f"The base URL is empty; write the server's address, {example}.")
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise BaseUrlError(f"The base URL {raw!r} must start with http:// or https:// ({example}).")
    try:
        port = parts.port  # raises on a port that is not a number or out of range
    except ValueError:
        raise BaseUrlError(f"The base URL {raw!r} has a port that is not a number from 0 to 65535.") from None
    if not parts.hostname or any(c.isspace() for c in raw):
        raise BaseUrlError(f"The base URL {raw!r} has no valid server name ({example}).")
    if parts.username or parts.password:
        raise BaseUrlError("Put the API key in the API key field, not in the base URL.")
    if parts.query or parts.fragment:
        raise BaseUrlError(f"The base URL {raw!r} should not have a query (?…) or fragment (#…).")
    path = parts.path.rstrip("/") or "/v1"
    netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc += f":{port}" if port is not None else ""
    return urlunsplit((parts.scheme, netloc, path, "", ""))


def server_root(base_url: str) -> str:
    """The URL without its trailing /v1: where llama.cpp's /props and the /tokenize endpoints
    of llama.cpp and vLLM live."""
    return base_url[:-3] if base_url.endswith("/v1") else base_url
