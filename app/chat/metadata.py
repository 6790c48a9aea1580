"""The saved metadata of a reply: one schema, written in one place.

A finished reply's message carries (all optional when reading; older rows lack some):

    model                  the model's name ("SmolLM2 135M Instruct", "llama-3.1-70b")
    backend                "local" or "remote" (who answered)
    finish_reason          "stop", "length" (cut by the limit: Continue is offered), "abort"
    prompt_tokens          the prompt's length in the model's tokens (a remote server's
                           figure, or an estimate when it gives none)
    cached_tokens          of those, read from a prefix cache instead of computed
    restored_tokens        of the cached ones, read back from the disk cache (local only)
    completion_tokens      the reply's tokens (a continued reply: all its parts together)
    tokens_per_s           decode speed
    time_to_first_token_s
    thinking_s             a reasoning model's thinking time (only when it thought)
    passages               the passages a searched question was answered from
                           (app/chat/documents.py; kept through every later update)
"""

from __future__ import annotations

from app.chat.documents import PASSAGES_KEY
from app.chat.replies import COMPLETE, ERROR, INTERRUPTED, STOPPED

KEYS = ("model", "backend", "finish_reason", "prompt_tokens", "cached_tokens", "restored_tokens",
        "completion_tokens", "tokens_per_s", "time_to_first_token_s", "thinking_s", PASSAGES_KEY)


def finished_metadata(model: str, backend: str, finished, *, earlier: dict | None = None,
                      thinking_s: float | None = None) -> dict:
    """The metadata of a reply that ended with `finished` (an engine Finished event).
    `earlier`: the metadata the reply had before a Continue (its completion tokens and
    thinking time carry over)."""
    earlier = earlier or {}
    usage, timings = finished.usage, finished.timings
    metadata = {"model": model, "backend": backend, "finish_reason": finished.finish_reason,
                "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                "restored_tokens": usage.restored_tokens,
                "completion_tokens": usage.completion_tokens + earlier.get("completion_tokens", 0),
                "tokens_per_s": round(timings.decode_tokens_per_s, 1),
                "time_to_first_token_s": round(timings.time_to_first_token_s, 3)}
    thought = thinking_s if thinking_s is not None else earlier.get("thinking_s")
    if thought is not None:
        metadata["thinking_s"] = round(thought or 0, 1)
    return metadata


def keep_passages(stored: dict | None, metadata: dict) -> dict:
    """`metadata` with the passages `stored` (the message's metadata so far) had: a reply's
    passages stay with it whatever else is rewritten."""
    kept = (stored or {}).get(PASSAGES_KEY)
    if kept is not None and PASSAGES_KEY not in metadata:
        return {**metadata, PASSAGES_KEY: kept}
    return metadata


def is_cut(metadata: dict | None) -> bool:
    """Whether a finished reply stopped at the length limit (Continue carries it on)."""
    return (metadata or {}).get("finish_reason") == "length"


def can_continue(status: str, metadata: dict | None, text: str) -> bool:
    """Whether Continue is offered for a saved reply: one cut by the length limit, or one
    that ended early with text to carry on from (stopped by the person, interrupted by a
    crash or a quit, or failed mid-stream with its text kept)."""
    if status == COMPLETE:
        return is_cut(metadata)
    return status in (STOPPED, INTERRUPTED, ERROR) and bool(text.strip())
