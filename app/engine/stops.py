"""Stop matching on the visible text, holding back what a stop string may still become.

`StopMatcher.feed(delta)` returns the text that is safe to show now. Text that could be the
start of a stop string stays held until the next delta decides it; when a stop string
completes, everything from its first character on is dropped and `stopped` turns True.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop_strings: tuple[str, ...] = ()):
        self.stop_strings = tuple(s for s in stop_strings if s)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stop_strings:
            return delta
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of a reply the held text was not a stop after all: release it."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
