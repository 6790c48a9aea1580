"""The set-up command's check that the window can open, and the package command it prints."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.ui import platform_check
from app.ui.platform_check import GuiCheck, check_gui_can_start, debian_package

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux check")


def test_library_names_map_to_debian_packages():
    assert debian_package("libxcb-cursor.so.0") == "libxcb-cursor0"
    assert debian_package("libxcb-icccm.so.4") == "libxcb-icccm4"
    assert debian_package("libxcb-keysyms.so.1") == "libxcb-keysyms1"
    assert debian_package("libxkbcommon-x11.so.0") == "libxkbcommon-x11-0"
    assert debian_package("libEGL.so.1") == "libegl1"
    check = GuiCheck(ok=False, missing_libraries=["libxcb-cursor.so.0", "libxcb-icccm.so.4"])
    assert check.apt_command() == "sudo apt-get install libxcb-cursor0 libxcb-icccm4"
    assert "sudo apt-get install libxcb-cursor0 libxcb-icccm4" in check.message()


def test_the_check_imports_no_qt():
    code = ("import sys, app.ui.platform_check; "
            "assert not any(m.startswith('PySide6') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=platform_check.ROOT)


@linux_only
def test_a_platform_that_starts_passes(monkeypatch):
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    monkeypatch.setenv("DISPLAY", ":0")
    assert check_gui_can_start().ok


@linux_only
def test_xcb_that_cannot_start_names_exactly_what_ldd_finds_missing(monkeypatch):
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setenv("DISPLAY", ":97")  # no X server there: xcb cannot start
    result = check_gui_can_start()
    assert not result.ok
    missing = platform_check.missing_xcb_libraries()
    assert result.missing_libraries == missing
    if missing:  # e.g. a clean Ubuntu: the exact command
        assert result.apt_command() == "sudo apt-get install " + " ".join(
            debian_package(lib) for lib in missing)
    else:  # all libraries there: the reason is Qt's own words
        assert result.detail
