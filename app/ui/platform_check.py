"""Can the window open on this machine? Checked by the set-up command, before the first start.

On a clean Debian/Ubuntu desktop, Qt's xcb plugin (X11, and XWayland) aborts at start-up
without a few small system libraries (libxcb-cursor0 since Qt 6.5, libxcb-icccm4,
libxcb-keysyms1). pip cannot install them, so this says the exact command that does.

Imports no Qt at import time: it asks a child Python to start Qt, and reads the plugin's
linked libraries with `ldd`. Run it as `python -m app.ui.platform_check` (exit status 1 when
the window cannot open, with the fix printed).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Loaded by the xcb plugin at run time, so `ldd` cannot see it missing.
_RUNTIME_LIBS = ("libxcb-cursor.so.0",)
_START_QT = ("import sys; from app.ui.qt import QtWidgets; "
             "QtWidgets.QApplication(sys.argv[:1]); print('ok')")


@dataclass
class GuiCheck:
    ok: bool
    missing_libraries: list[str] = field(default_factory=list)  # sonames
    detail: str = ""  # what Qt said, when it failed to start

    def apt_command(self) -> str:
        packages = " ".join(debian_package(lib) for lib in self.missing_libraries)
        return f"sudo apt-get install {packages}" if packages else ""

    def message(self) -> str:
        if self.ok:
            return "The window can open here."
        lines = ["Ferrox Chat's window cannot open on this machine."]
        if self.missing_libraries:
            lines.append("Qt needs system libraries that are missing: "
                         + ", ".join(self.missing_libraries) + ".")
            lines.append(f"Install them with:\n    {self.apt_command()}")
        if self.detail and not self.missing_libraries:
            lines.append("Qt said: " + self.detail)
        return "\n".join(lines)


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package of a library: libxcb-icccm.so.4 -> libxcb-icccm4,
    libxkbcommon-x11.so.0 -> libxkbcommon-x11-0, libEGL.so.1 -> libegl1."""
    match = re.match(r"(lib[\w+.-]+?)\.so\.(\d+)", soname)
    if not match:
        return soname
    name, major = match.group(1).lower(), match.group(2)
    return f"{name}-{major}" if name[-1].isdigit() else f"{name}{major}"


def xcb_plugin() -> Path | None:
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    plugin = Path(list(spec.submodule_search_locations)[0]) / "Qt/plugins/platforms/libqxcb.so"
    return plugin if plugin.is_file() else None


def missing_xcb_libraries() -> list[str]:
    """Libraries the xcb plugin needs that this system lacks (Linux; [] elsewhere)."""
    plugin = xcb_plugin()
    if plugin is None or not shutil.which("ldd"):
        return []
    try:
        listing = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    missing = re.findall(r"^\s*(\S+) => not found", listing, re.MULTILINE)
    for lib in _RUNTIME_LIBS:
        if ctypes.util.find_library(lib.split(".so")[0][3:]) is None:
            missing.append(lib)
    return sorted(set(missing))


def gui_platform() -> str:
    """The Qt platform the person's start will use: QT_QPA_PLATFORM, else Qt's own choice."""
    chosen = os.environ.get("QT_QPA_PLATFORM", "")
    if chosen:
        return chosen.split(":")[0].split(";")[0]
    if os.environ.get("WAYLAND_DISPLAY"):
        return "wayland"
    return "xcb" if sys.platform.startswith("linux") else ""


def check_gui_can_start(python: str = sys.executable, timeout: float = 60.0) -> GuiCheck:
    """Start Qt in a child process the way the app will; on Linux also list what the xcb
    plugin lacks (even without a display, e.g. over ssh, where starting cannot tell)."""
    if not sys.platform.startswith("linux"):
        return GuiCheck(ok=True)
    platform = gui_platform()
    missing = missing_xcb_libraries() if platform in ("xcb", "") else []
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) \
            and platform in ("xcb", "wayland", ""):
        return GuiCheck(ok=not missing, missing_libraries=missing)  # nothing to start on here
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        child = subprocess.run([python, "-c", _START_QT], capture_output=True, text=True,
                               timeout=timeout, cwd=ROOT, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return GuiCheck(ok=False, missing_libraries=missing, detail=str(exc))
    if child.returncode == 0 and "ok" in child.stdout:
        return GuiCheck(ok=True)
    # Qt names xcb-cursor whenever the plugin fails to load, whatever was missing: the
    # list above (ldd and the loader's own search) is the one to trust.
    return GuiCheck(ok=False, missing_libraries=missing, detail=_qt_complaint(child.stderr))


def _qt_complaint(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return next((line for line in lines if "plugin" in line.lower()), lines[0] if lines else "")


def main() -> int:
    result = check_gui_can_start()
    if not result.ok:
        print(result.message(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
