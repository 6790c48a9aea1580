"""The built-in models as the GUI shows them: picker keys and labels, which one new chats
start with, and which are base models (they continue text rather than chat).

The table itself is `app.models.embedded.BUILTIN_MODELS`; this module only adapts it for
the picker (no torch here)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from app.models import embedded

BUILTIN_PREFIX = "builtin:"
LEGACY_KEYS = ("embedded", "default")  # settings saved by earlier versions, and --model default


def builtin_models() -> list:
    """BuiltinModel records, the default first."""
    return sorted(embedded.BUILTIN_MODELS, key=lambda m: not m.is_default)


def picker_key(model) -> str:
    return BUILTIN_PREFIX + model.key


def default_key() -> str:
    return picker_key(embedded.DEFAULT_MODEL)


def builtin_for_key(key: str):
    """The BuiltinModel behind picker key `key`, or None for an added model's path."""
    if key in LEGACY_KEYS:
        key = default_key()
    if not key.startswith(BUILTIN_PREFIX):
        return None
    name = key[len(BUILTIN_PREFIX):]
    return next((m for m in builtin_models() if m.key == name), None)


def picker_label(model) -> str:
    """e.g. "SmolLM2 135M Instruct (built in)", "Gemma 3 270M (built in · base model: continues text)"."""
    if getattr(model, "kind", "chat") == "base":
        return f"{model.display_name} (built in · base model: continues text)"
    return f"{model.display_name} (built in)"


def builtin_at(path: str):
    """The BuiltinModel whose file `path` is (by file name), or None for an added model."""
    name = Path(path).name
    return next((m for m in builtin_models() if m.filename == name), None)


def writes_titles(path: str) -> bool:
    """Whether the model at `path` is asked to title chats: added models are; built-ins too
    small to summarise (or base models) are not, and the chat keeps its first-message title."""
    model = builtin_at(path)
    return model is None or model.writes_titles


def ensure_builtin(key: str, models_dir: str,
                   progress: Callable[[int, int], None] | None = None) -> Path:
    """The verified file of built-in model `key` (a picker key), put in `models_dir` first
    if needed. Raises ModelError with a message to show."""
    model = builtin_for_key(key) or embedded.DEFAULT_MODEL
    return embedded.ensure_builtin_model(model.key, Path(models_dir), progress)


def refusal_of(facts) -> str:
    """Why a model that was read cannot run, as the model facts put it."""
    for field in ("problem", "refusal", "reason"):
        message = getattr(facts, field, "")
        if message:
            return message
    return (f"{facts.name} is a {facts.architecture!r} model, which this version of Ferrox "
            "Chat cannot run.")
