"""How many CPU threads the engine's passes use, learned from the passes themselves.

Why: torch's OpenMP threads wait for each other at the end of every parallel region. When
another program keeps one of the cores busy (a browser, a build, a second model), a thread
that was descheduled holds up the whole team, and every one of the hundreds of small products
in a decode pass pays for it. Measured on a 2-core AMD EPYC (AVX-512) while other jobs ran:
SmolLM2 decoded at 3-10 tok/s on 2 threads and at 39-59 tok/s on 1; on the same machine idle,
2 threads gave 80 tok/s against 1 thread's ~60. No fixed count is right on a shared machine,
and the machine's load changes while a chat streams.

So the engine keeps running on its current count and now and then runs a few passes on the
other candidate (`most` threads, or half of them), comparing passes of the same size taken
back to back. A probe whose first counted pass is slower is cut short (`GIVE_UP`). When to
probe depends on the count it runs on:
- On all threads, contention shows as passes far slower than this count's own settled
  level (3-10x; `SLOWDOWN`), so after the first probe (`FIRST_PROBE`) it probes when they
  slow down, and otherwise only every `MAX_EVERY` passes. Probing on a schedule instead cost
  an idle machine ~4 probes in a 128-token reply, 2 slower passes each (SmolLM2 decode 75.2
  against 79.6 tok/s without probes, one run side by side).
- On fewer threads nothing slows down when the other program ends (the passes just stay
  slower than all threads would be), so it probes on a schedule: `EVERY` passes after a
  switch, the wait doubling after each failed probe up to `MAX_EVERY`.

Thread counts change only between passes, on the engine's own thread (torch's intra-op count
is that thread's setting). Results do not depend on it: torch's CPU kernels split work by
output rows or columns, never a reduction, so greedy tokens stay the same (tested).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

PROBE_PASSES = 5  # passes run on the other count per probe (the first is not counted)
SLOWDOWN = 1.5  # on all threads, a window of passes this much slower than the settled level probes
FIRST_PROBE = 8  # passes before the first probe: a busy machine is found within a second
EVERY = 48  # passes between probes after a probe that switched (or at the start)
MAX_EVERY = 1536  # the longest wait between probes, after many probes that kept the count
MARGIN = 0.08  # the other count must be this much faster to be taken
# A counted probe pass this many times the current median ends the probe at once. The other
# count must be MARGIN faster to be taken, so a pass not even as fast argues against it, and
# every probe pass runs at the other count's speed: on an idle 2-core machine one thread is
# ~1.5x slower, and three 5-pass probes in a 128-token reply cost its decode 4-8% (Gemma 3
# 270M, 45.8-47.1 against 47.6-50.1 tok/s without probes). A busy machine's gain is 3-10x,
# plain from the first counted pass.
GIVE_UP = 1.0


class ThreadTuner:
    """Call `before_pass()` before each forward pass (it applies the count for that pass) and
    `after_pass(rows, seconds)` after it; `rows` is the pass's token count, so only passes of
    the same size are compared. `set_threads` is torch.set_num_threads in the engine."""

    def __init__(self, most: int, set_threads: Callable[[int], None]):
        self.most = max(1, most)
        self.candidates = sorted({self.most, max(1, self.most // 2)}, reverse=True)
        self.current = self.most
        self._set = set_threads
        self._applied: int | None = None
        self._every = FIRST_PROBE
        self._since_probe = 0
        self._recent: deque[tuple[int, float]] = deque(maxlen=PROBE_PASSES)
        # Pass size -> the median of the first full window on the current count since the
        # last probe: the level a slowdown is judged against.
        self._settled: dict[int, float] = {}
        self._probe: list[float] | None = None  # the probe's timings, while one runs
        self._probe_rows = 0
        self.switches = 0  # how often the count changed (for bench and tests)
        self.probes = 0

    @property
    def enabled(self) -> bool:
        return len(self.candidates) > 1

    @property
    def probing(self) -> bool:
        return self._probe is not None

    @property
    def other(self) -> int:
        return next(c for c in self.candidates if c != self.current)

    def threads_for_pass(self) -> int:
        return self.other if self.probing else self.current

    def before_pass(self) -> None:
        if not self.enabled:
            return  # one candidate: the count is whatever the process set
        wanted = self.threads_for_pass()
        if wanted != self._applied:
            self._set(wanted)
            self._applied = wanted

    def after_pass(self, rows: int, seconds: float) -> None:
        if not self.enabled:
            return
        if self._probe is not None:
            self._probe_pass(rows, seconds)
            return
        if self._recent and self._recent[-1][0] != rows:
            self._recent.clear()  # a different pass size: compare like with like
        self._recent.append((rows, seconds))
        self._since_probe += 1
        if len(self._recent) < self._recent.maxlen:
            return
        due = self._since_probe >= self._every
        if not due and self.current == self.most:
            level = statistics.median(s for _, s in self._recent)
            due = level > SLOWDOWN * self._settled.setdefault(rows, level)
        if due:
            self._probe, self._probe_rows, self._since_probe = [], rows, 0
            self.probes += 1

    def _probe_pass(self, rows: int, seconds: float) -> None:
        assert self._probe is not None
        if rows != self._probe_rows:  # the work changed under the probe: try again later
            self._end_probe(switch=False, spaced=False)
            return
        self._probe.append(seconds)
        baseline = statistics.median(s for _, s in self._recent)
        counted = self._probe[1:]  # the first pass on a new count pays for waking its threads
        if counted and counted[-1] > GIVE_UP * baseline:
            self._end_probe(switch=False)
        elif len(self._probe) >= PROBE_PASSES:
            self._end_probe(switch=statistics.median(counted) < baseline * (1 - MARGIN))

    def _end_probe(self, switch: bool, spaced: bool = True) -> None:
        if switch:
            self.current = self.other
            self.switches += 1
            self._every = EVERY
        elif spaced:
            # All threads held: a slowdown calls the next probe, the schedule only backs it up.
            self._every = MAX_EVERY if self.current == self.most else min(MAX_EVERY, self._every * 2)
        self._probe = None
        self._recent.clear()
        self._settled.clear()
