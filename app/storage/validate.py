"""Loose checks on what callers hand the store, so bad values fail with a plain StorageError
at the call that made them, not later in the engine or in an export.

"Loose": known generation settings must have a sensible type and range, unknown keys are kept
as long as they are JSON, and a value of None means "back to the default" (the key is dropped).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from app.storage.errors import StorageError
from app.storage.records import ROLES, STATUSES


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _within(low: float, high: float):
    return lambda v: _number(v) and low <= v <= high


# key -> (test, what it must be). Plain checks, kept apart from app.engine.sampling (which
# imports torch); every entry -- settings dialogs, model defaults, imported chats -- passes
# here. The ranges are wide but exclude values that break the arithmetic: a temperature or
# repetition penalty of 1e-300 divides logits into infinities and empties the candidates.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_PENALTY = 100.0  # presence and frequency penalties, either sign
MAX_TOP_K = 1_000_000
MAX_MAX_TOKENS = 10_000_000
_SETTING_RULES = {
    "system_prompt": (lambda v: isinstance(v, str), "text"),
    "temperature": (lambda v: _number(v) and (v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE),
                    f"0 (greedy) or a number from {MIN_TEMPERATURE} to {MAX_TEMPERATURE:g}"),
    "top_k": (lambda v: _integer(v) and 0 <= v <= MAX_TOP_K, f"a whole number from 0 to {MAX_TOP_K:,}"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number above 0 and at most 1"),
    "min_p": (_within(0, 1), "a number from 0 to 1"),
    "max_tokens": (lambda v: _integer(v) and 1 <= v <= MAX_MAX_TOKENS,
                   f"a whole number from 1 to {MAX_MAX_TOKENS:,}"),
    "seed": (lambda v: _integer(v) and -(1 << 63) <= v < 1 << 64, "a whole number (64-bit)"),
    "repetition_penalty": (_within(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
                           f"a number from {MIN_REPETITION_PENALTY} to {MAX_REPETITION_PENALTY:g}"),
    "presence_penalty": (_within(-MAX_PENALTY, MAX_PENALTY), f"a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g}"),
    "frequency_penalty": (_within(-MAX_PENALTY, MAX_PENALTY), f"a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g}"),
}


def check_role(role: Any) -> str:
    if role not in ROLES:
        raise StorageError(f"A message role must be one of {', '.join(ROLES)}, not {role!r}.")
    return role


def check_status(status: Any) -> str:
    if status not in STATUSES:
        raise StorageError(f"A message status must be one of {', '.join(STATUSES)}, not {status!r}.")
    return status


def check_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise StorageError(f"{what} must be text, not {type(value).__name__}.")
    return value


def check_generation_settings(settings: Mapping[str, Any] | None, what: str = "Chat settings") -> dict[str, Any]:
    """A checked copy of per-chat settings or per-model defaults (None values kept: they
    mean "drop this key" to the caller that merges)."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise StorageError(f"{what} must be a dictionary, not {type(settings).__name__}.")
    checked = {}
    for key, value in settings.items():
        if not isinstance(key, str):
            raise StorageError(f"{what} keys must be text, not {key!r}.")
        rule = _SETTING_RULES.get(key)
        if value is not None and rule is not None and not rule[0](value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "…"
            raise StorageError(f"{what}: {key} must be {rule[1]}, not {shown}.")
        checked[key] = value
    to_json(checked, what)
    return checked


def merged(current: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`current` updated by `changes`; a None in `changes` removes that key."""
    result = dict(current)
    for key, value in changes.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def to_json(value: Any, what: str) -> str:
    """JSON text for a dict column; StorageError if `value` is not a JSON-able dict."""
    if not isinstance(value, Mapping):
        raise StorageError(f"{what} must be a dictionary, not {type(value).__name__}.")
    try:
        return json.dumps(dict(value), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise StorageError(f"{what} cannot be saved as JSON: {error}.") from None


def check_attachment(attachment: Any) -> tuple[str, str, str, int, int, str | None]:
    """(name, kind, text, token_count, size_bytes, sha256) of a NewAttachment or an
    Attachment."""
    try:
        fields = (attachment.name, attachment.kind, attachment.text,
                  attachment.token_count, attachment.size_bytes)
    except AttributeError:
        raise StorageError(f"An attachment must be a NewAttachment, not {type(attachment).__name__}.") from None
    name, kind, text, tokens, size = fields
    if not isinstance(name, str) or not name.strip():
        raise StorageError("An attachment needs a name.")
    check_text(kind, "An attachment's kind")
    check_text(text, f"The text of attachment {name!r}")
    if not (_integer(tokens) and tokens >= 0 and _integer(size) and size >= 0):
        raise StorageError(f"Attachment {name!r}: token_count and size_bytes must be whole numbers, 0 or more.")
    sha256 = getattr(attachment, "sha256", None)
    if sha256 is not None and not isinstance(sha256, str):
        raise StorageError(f"Attachment {name!r}: sha256 must be text.")
    return name, kind, text, tokens, size, sha256
