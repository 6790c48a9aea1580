"""Storage fixtures: a store in the test's own data directory, on a clock that ticks one
second per reading so "most recent" never depends on how fast the machine is."""

from __future__ import annotations

import pytest

from app.storage import ChatStore


class TickClock:
    def __init__(self, start: float = 1_700_000_000.0):
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> TickClock:
    return TickClock()


@pytest.fixture
def store(clock):
    with ChatStore(clock=clock) as opened:  # data_dir(): the test's own FERROX_DATA_DIR
        yield opened
