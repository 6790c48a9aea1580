"""The context budget: one function decides how many tokens a reply may take.

A model's context holds the prompt and the reply together. Every caller asks `plan_reply`:
  - the window (through the bridge's worker, for local models and for a connection's model
    whose context is known, set by the person or reported by the server): the reply's
    length limit is lowered to what the context has left (`clamp=True`; a remote request's
    max_tokens), and a prompt that leaves fewer than MIN_REPLY_TOKENS is refused before it
    is sent (the window offers to shorten documents);
  - the API server: a request's explicit `max_tokens` is never lowered (`clamp=False`: a
    prompt plus reply over the context is a 400, as vLLM answers); without one the reply gets
    what the context leaves, up to the server's default;
  - the engine's admission check (`Engine._refusal`) asks it with `clamp=False`.
Document fitting uses `reply_room`: the room kept free for a reply when deciding whether
documents go whole or are searched.

This module imports nothing (see app/chat/__init__.py): lower layers may use it.
"""

from __future__ import annotations

from typing import NamedTuple

# Below this many free tokens a reply is not worth starting (the window's rule).
MIN_REPLY_TOKENS = 16
# Document fitting keeps this much room for a reply at most (a 32k max_tokens setting must not
# send every document to search).
MAX_REPLY_ROOM = 1024


class ReplyPlan(NamedTuple):
    """`max_tokens`: what the reply may take (0 when it does not fit); `room`: what the
    context leaves after the prompt; `fits`: whether the reply may start."""

    max_tokens: int
    room: int
    fits: bool
    prompt_tokens: int
    context: int

    @property
    def over(self) -> int:
        """Tokens over the context: the prompt alone, or prompt + requested reply."""
        return max(0, self.prompt_tokens + max(self.max_tokens, 0) - self.context)


def plan_reply(context: int, prompt_tokens: int, requested: int | None, *, clamp: bool = True,
               default: int | None = None, min_reply: int = 1) -> ReplyPlan:
    """How long the reply to a prompt of `prompt_tokens` may be in a context of `context`.

    `requested`: the reply length asked for (None: as much as fits, up to `default`).
    `clamp`: lower `requested` to the room left (the window) rather than refuse it (the API).
    `min_reply`: the fewest tokens worth a reply; less room than that does not fit.
    An empty prompt still takes one position (BOS, or the filler token the engine runs)."""
    prompt_tokens = max(prompt_tokens, 1)
    room = context - prompt_tokens
    if room < max(min_reply, 1):
        return ReplyPlan(0, room, False, prompt_tokens, context)
    if requested is None:
        wanted = room if default is None else min(room, default)
        return ReplyPlan(wanted, room, True, prompt_tokens, context)
    if requested <= room:
        return ReplyPlan(requested, room, True, prompt_tokens, context)
    if clamp:
        return ReplyPlan(room, room, True, prompt_tokens, context)
    return ReplyPlan(requested, room, False, prompt_tokens, context)


def fits(context: int, prompt_tokens: int, max_tokens: int) -> bool:
    """Whether a prompt and a reply of at most `max_tokens` fit the context together."""
    return plan_reply(context, prompt_tokens, max_tokens, clamp=False).fits


def reply_room(max_tokens: int) -> int:
    """Room document fitting keeps for the reply: the chat's reply length, at most
    MAX_REPLY_ROOM."""
    return max(0, min(max_tokens, MAX_REPLY_ROOM))
