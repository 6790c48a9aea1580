"""A reasoning model's reply as the view shows it: the thinking apart from the answer.

The splitting itself belongs to the models layer (`app.models.reasoning`, no torch); this
module only turns its result into the fields of a `MessageItem`."""

from __future__ import annotations

from dataclasses import replace

from app.models.reasoning import split_reasoning
from app.ui.view_models import LIVE_STATUSES, MessageItem

__all__ = ["split_reasoning", "split_reply"]


def split_reply(item: MessageItem, thinking_s: float | None) -> MessageItem:
    """`item` with its thinking moved to `reasoning` and labelled: "Thinking…" while it is
    still being written, "Thought for N s" once the answer has begun."""
    reasoning, answer = split_reasoning(item.text)
    if reasoning is None:
        return item
    thinking = item.status in LIVE_STATUSES and not answer.strip() and thinking_s is None
    if thinking:
        label = "Thinking…"
    elif thinking_s is not None:
        label = f"Thought for {max(thinking_s, 1):.0f} s"
    else:
        label = "Thoughts"
    return replace(item, text=answer.lstrip("\n"), reasoning=reasoning.strip(),
                   reasoning_label=label)
