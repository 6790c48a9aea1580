"""`python -m app generate --chat --base-url URL ...`: one reply from a remote server through
the same `RemoteBackend` the app uses, printed as the local `generate` prints it."""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

from app.backends.base import BackendError
from app.backends.base_url import BaseUrlError
from app.backends.remote import RemoteBackend, RemoteSettings
from app.engine.events import Event, Failed, Finished, Token


def remote_settings_from_args(args) -> RemoteSettings:
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise BackendError(f"--api-key-env names {args.api_key_env}, but that environment "
                               "variable is not set.")
    try:
        return RemoteSettings(args.base_url, api_key=api_key)
    except BaseUrlError as exc:
        raise BackendError(str(exc)) from None


def generate_remote(args, params) -> dict:
    """Run one chat reply on the server; stream its text to stdout unless `args.json`.
    Returns the JSON object `generate --json` prints. Raises BackendError on any failure."""
    if not args.chat or args.prompt is None:
        raise BackendError("--base-url talks to a chat endpoint: give --prompt text with --chat.")
    if params.top_logprobs:
        raise BackendError("--top-logprobs is not available with --base-url.")
    from app.models.chat_template import Message

    backend = RemoteBackend(remote_settings_from_args(args))
    try:
        started = time.monotonic()
        model = _choose_model(backend, args.remote_model)
        load_s = time.monotonic() - started
        end = _one_reply(backend, [Message("user", args.prompt)], params, stream=not args.json)
    finally:
        backend.close()
    if isinstance(end, Failed):
        raise BackendError(end.message)
    return {
        "model": model.name,
        "device": model.location,
        "dtype": "remote",
        "prompt_ids": [],  # a remote server streams text, not ids
        "completion_ids": [],
        "text": end.text,
        "finish_reason": end.finish_reason,
        "logprobs": [],
        "usage": {"prompt_tokens": end.usage.prompt_tokens,
                  "cached_tokens": end.usage.cached_tokens,
                  "completion_tokens": end.usage.completion_tokens},
        "timings": {"load_s": round(load_s, 4),
                    "prefill_s": round(end.timings.prefill_s, 4),
                    "decode_tokens_per_s": round(end.timings.decode_tokens_per_s, 2)},
    }


def _choose_model(backend: RemoteBackend, name: str | None):
    if name:
        return backend.load(name)
    models = backend.list_models()
    if len(models) != 1:
        offered = ", ".join(m.name for m in models[:10]) or "none"
        raise BackendError(f"Choose a model with --remote-model; the server offers: {offered}.")
    return backend.load(models[0].name)


def _one_reply(backend: RemoteBackend, messages, params, *, stream: bool) -> Finished | Failed:
    done = threading.Event()
    ends: list[Event] = []

    def on_event(event: Event) -> None:
        if isinstance(event, Token) and stream:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, (Finished, Failed)):
            ends.append(event)
            done.set()

    request_id = backend.submit_chat(messages, params, on_event, session_id=uuid.uuid4().hex)
    try:
        done.wait()
    except KeyboardInterrupt:
        backend.abort(request_id)
        raise
    if stream:
        sys.stdout.write("\n")
    return ends[0]
