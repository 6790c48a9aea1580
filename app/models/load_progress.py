"""Progress inside one weight's preparation, for the loader's progress report.

The loader reports progress per tensor, weighted by its size (`loader._reporting`). One tensor
can take most of a load: Gemma 3 270M's tied 262,144-row embedding is ~60% of its values,
and screening it (`quantized.screen_raw`) took ~1 s of a ~3 s first load, with the status bar
still at 0%. Code that prepares a large weight in row chunks calls `report_within` after each
chunk; the loader turns that fraction of the tensor into a fraction of the load.

The callback lives in a context variable: each thread has its own, so a load in one thread
never reports into another's. Without a callback (a weight prepared outside a load, a test)
`report_within` does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

_within: ContextVar[Callable[[float], None] | None] = ContextVar("load_progress_within", default=None)


def report_within(fraction: float) -> None:
    """Tell the load how far the weight being prepared is, 0..1."""
    callback = _within.get()
    if callback is not None:
        callback(fraction)


def set_within(callback: Callable[[float], None] | None) -> None:
    """Where `report_within` reports from now on in this thread (None: nowhere)."""
    _within.set(callback)
