"""Replies in progress: moved to the chat service (app/chat/replies.py); the window keeps its
save beat here."""

from __future__ import annotations

from app.chat.replies import ActiveReply, Outcome, ReplyBook  # noqa: F401

# The controller saves changed replies on this beat: the README promises "at least twice a
# second", and a tick that a busy GUI thread runs late still leaves room within 0.5 s.
SAVE_INTERVAL_MS = 250
