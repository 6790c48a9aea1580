"""The frozen app end to end: build it with PyInstaller (minutes) and run its --self-test.

Skipped unless FERROX_TEST_FROZEN=1. With FERROX_FROZEN_APP pointing at an existing build
(the dist/ferrox-chat folder, a ferrox-chat.app, or the executable itself) nothing is built:

    FERROX_TEST_FROZEN=1 .venv/bin/python -m pytest tests/packaging -m slow
    FERROX_TEST_FROZEN=1 FERROX_FROZEN_APP=dist/ferrox-chat .venv/bin/python -m pytest tests/packaging -m slow
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("FERROX_TEST_FROZEN") != "1",
                       reason="builds the frozen app (minutes); set FERROX_TEST_FROZEN=1"),
]


def frozen_executable(path: Path) -> Path:
    if path.is_file():
        return path
    if path.suffix == ".app":
        return path / "Contents" / "MacOS" / "ferrox-chat"
    for name in ("ferrox-chat-cli.exe", "ferrox-chat"):  # Windows: the console twin
        if (path / name).is_file():
            return path / name
    raise AssertionError(f"no ferrox-chat executable in {path}")


def offscreen_env() -> dict[str, str]:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONIOENCODING="utf-8")
    env.pop("FERROX_DATA_DIR", None)
    return env


@pytest.mark.skipif(not os.environ.get("FERROX_FROZEN_APP"), reason="FERROX_FROZEN_APP not set")
def test_existing_frozen_app_self_test(tmp_path):
    exe = frozen_executable(Path(os.environ["FERROX_FROZEN_APP"]).resolve())
    result = subprocess.run([str(exe), "--self-test", "--data-dir", str(tmp_path / "data")],
                            env=offscreen_env(), capture_output=True, text=True, timeout=900,
                            encoding="utf-8", errors="replace")
    assert result.returncode == 0, result.stdout + result.stderr
    replies = [ln for ln in result.stdout.splitlines() if ln.startswith("self-test reply")]
    assert replies and replies[-1].split(": ", 1)[1].strip("'\" "), result.stdout


@pytest.mark.skipif(bool(os.environ.get("FERROX_FROZEN_APP")), reason="testing an existing build")
def test_build_and_self_test():
    result = subprocess.run([sys.executable, str(ROOT / "packaging" / "build.py"), "--self-test"],
                            cwd=ROOT, env=offscreen_env(), capture_output=True, text=True,
                            timeout=3600, encoding="utf-8", errors="replace")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "frozen self-test : PASS" in result.stdout, output[-6000:]
    reply = next(ln for ln in result.stdout.splitlines() if ln.startswith("reply "))
    assert "self-test reply" in reply and not reply.endswith("None"), reply
