"""scripts/bench_vector_ops.py times the 8-bit kernel's instruction patterns on this CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_vector_ops.py"


def test_each_pattern_is_timed_in_cycles_of_a_measured_clock():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    if result.returncode and ("no AVX2" in result.stdout or "nothing to time" in result.stdout):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr
    ghz = float(re.search(r"~([\d.]+) GHz", result.stdout).group(1))
    assert 0.3 < ghz < 10
    cycles = [float(c) for c in re.findall(r"([\d.]+) cycles each", result.stdout)]
    assert len(cycles) == 6 and all(0.05 < c < 20 for c in cycles)
