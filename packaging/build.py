#!/usr/bin/env python3
"""Build the double-clickable Ferrox Chat app for this platform with PyInstaller.

    python packaging/build.py                  # build into dist/ (one folder; .app on macOS)
    python packaging/build.py --self-test      # build, then run the frozen app's --self-test
    python packaging/build.py --self-test --no-build   # test the existing dist/ build only
    python packaging/build.py --install-deps   # pip install -r packaging/requirements-build.txt first

Run it with the Python of the environment the app is installed in (the project's .venv):
PyInstaller freezes that environment's torch, PySide6 and model packages. Nothing is installed
unless --install-deps is given.

Output:
  Linux    dist/ferrox-chat/ferrox-chat            (+ ferrox-chat.desktop, ferrox-chat.png)
  Windows  dist/ferrox-chat/ferrox-chat.exe        (+ ferrox-chat-cli.exe, the console twin)
  macOS    dist/ferrox-chat.app                    (and dist/ferrox-chat/, the same files)

--self-test runs the frozen app twice, with QT_QPA_PLATFORM=offscreen and a fresh temporary
data folder: first with --exit-when-shown (cold start: the time until the main window is
shown), then with --self-test (one message through the GUI; the model is assembled into
the data folder on this first run). It prints the exit code, the reply, the timings and the
bundle size, and exits non-zero if the self-test failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"
SPEC = PACKAGING / "ferrox-chat.spec"
APP_NAME = "ferrox-chat"
IS_WIN = sys.platform == "win32"
IS_MAC = sys.platform == "darwin"
SELF_TEST_TIMEOUT_S = 900
PROBE_TIMEOUT_S = 300


def log(message: str) -> None:
    print(f"[build] {message}", flush=True)


def run(cmd: list[str], **kwargs) -> None:
    log("+ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kwargs)


def folder_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            file = Path(dirpath, name)
            if not file.is_symlink():
                total += file.stat().st_size
    return total


def bundle_path(dist: Path) -> Path:
    """What a user gets: the .app on macOS, the folder elsewhere."""
    return dist / f"{APP_NAME}.app" if IS_MAC else dist / APP_NAME


def frozen_executable(dist: Path) -> Path:
    """The executable that has a usable stdout (for the self-test)."""
    if IS_WIN:
        return dist / APP_NAME / f"{APP_NAME}-cli.exe"
    if IS_MAC and (dist / f"{APP_NAME}.app").is_dir():
        return dist / f"{APP_NAME}.app" / "Contents" / "MacOS" / APP_NAME
    return dist / APP_NAME / APP_NAME


def make_icons() -> None:
    """resources/icon.ico and icon.icns are committed; make them only if they are missing."""
    needed = [ROOT / "resources" / n for n in ("icon.ico", "icon.icns")]
    if all(p.is_file() for p in needed):
        return
    env = dict(os.environ, QT_QPA_PLATFORM=os.environ.get("QT_QPA_PLATFORM", "offscreen"))
    run([sys.executable, str(PACKAGING / "make_icons.py"), "--if-missing"], env=env)


def write_linux_desktop_entry(folder: Path) -> Path:
    """ferrox-chat.desktop (+ the icon) in the build folder, with absolute Exec/Icon paths.

    Copy or symlink it into ~/.local/share/applications/ to get a launcher; if the folder is
    moved, run this script again (or edit the two paths)."""
    icon = folder / f"{APP_NAME}.png"
    shutil.copy2(ROOT / "resources" / "icon.png", icon)
    template = (PACKAGING / "linux" / f"{APP_NAME}.desktop").read_text(encoding="utf-8")
    text = template.replace("@EXEC@", _desktop_quote(str(folder / APP_NAME)))
    text = text.replace("@ICON@", str(icon))
    desktop = folder / f"{APP_NAME}.desktop"
    desktop.write_text(text, encoding="utf-8")
    desktop.chmod(0o755)
    return desktop


def _desktop_quote(path: str) -> str:
    """Quote an Exec= argument per the Desktop Entry spec when it needs it."""
    path = path.replace("%", "%%")
    if not any(c in path for c in ' \t\n"\'\\><~|&;$*?#()`'):
        return path
    escaped = path.replace("\\", "\\\\\\\\").replace('"', '\\\\"').replace("`", "\\\\`")
    escaped = escaped.replace("$", "\\\\$")
    return f'"{escaped}"'


def compile_avx2_kernel(folder: Path) -> bool:
    """Compile the 8-bit activation kernel's AVX2 version (`app.models.int8_products`) into
    `folder`, for the bundle to carry: its machine code is the same on every AVX2 machine, so
    the app's first start there decodes with it before compiling anything (~4 s). torch is
    held to its AVX2 kernels for this (the kernel follows torch's instruction set); on a
    machine without AVX2, or not x86, nothing is made and the app compiles its own."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", FERROX_KERNEL_CACHE_DIR=str(folder))
    probe = ("from app.models import int8_products as k\n"
             "print('kernel for the bundle:', k.kernel().isa if k.available() else k.unavailable_reason())")
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, timeout=PROBE_TIMEOUT_S)
    return any(folder.glob("*.o"))


def build(dist: Path, work: Path, clean: bool) -> float:
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        sys.exit("PyInstaller is not installed in this Python. Run:\n"
                 f"  {sys.executable} -m pip install -r packaging/requirements-build.txt\n"
                 "or pass --install-deps.")
    make_icons()
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
           "--distpath", str(dist), "--workpath", str(work), str(SPEC)]
    if clean:
        cmd.insert(4, "--clean")
    started = time.monotonic()
    kernels = work / "kernel-cache"
    env = dict(os.environ)
    if compile_avx2_kernel(kernels):  # (the spec puts it in the bundle)
        env["FERROX_BUNDLE_KERNELS"] = str(kernels)
    run(cmd, cwd=ROOT, env=env)
    elapsed = time.monotonic() - started
    if sys.platform.startswith("linux"):
        desktop = write_linux_desktop_entry(dist / APP_NAME)
        log(f"wrote {desktop}")
    return elapsed


def _offscreen_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["QT_QPA_PLATFORM"] = "offscreen"
    env.pop("FERROX_DATA_DIR", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONIOENCODING"] = "utf-8"  # the reply may hold any character (Windows code pages)
    env.update(extra)
    return env


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def measure_cold_start(exe: Path, data_dir: Path) -> dict:
    cmd = [str(exe), "--data-dir", str(data_dir), "--exit-when-shown"]
    log("+ " + " ".join(cmd))
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=_offscreen_env(data_dir),
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              encoding="utf-8", errors="replace")
    except subprocess.TimeoutExpired:
        return {"ok": False, "wall_s": PROBE_TIMEOUT_S, "detail": "timed out"}
    wall = time.monotonic() - started
    probe = [ln for ln in proc.stdout.splitlines() if ln.startswith("window shown after")]
    return {"ok": proc.returncode == 0 and bool(probe), "returncode": proc.returncode,
            "wall_s": wall, "detail": probe[-1] if probe else _tail(proc.stdout + proc.stderr)}


def run_self_test(exe: Path, data_dir: Path) -> dict:
    cmd = [str(exe), "--self-test", "--data-dir", str(data_dir)]
    log("+ " + " ".join(cmd))
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=_offscreen_env(data_dir), capture_output=True, text=True,
                              timeout=SELF_TEST_TIMEOUT_S, encoding="utf-8", errors="replace")
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode("utf-8", "replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        return {"returncode": None, "wall_s": SELF_TEST_TIMEOUT_S, "reply": None,
                "output": _tail(out) + "\n(timed out)"}
    wall = time.monotonic() - started
    replies = [ln for ln in proc.stdout.splitlines() if ln.startswith("self-test reply")]
    return {"returncode": proc.returncode, "wall_s": wall, "reply": replies[-1] if replies else None,
            "output": _tail(proc.stdout + "\n" + proc.stderr)}


def self_test(dist: Path, keep_data: bool) -> int:
    exe = frozen_executable(dist)
    if not exe.is_file():
        log(f"no frozen app at {exe}; build first")
        return 2
    data_dir = Path(tempfile.mkdtemp(prefix="ferrox-frozen-selftest-"))
    try:
        cold = measure_cold_start(exe, data_dir)
        result = run_self_test(exe, data_dir)
        warm = measure_cold_start(exe, data_dir)  # model assembled: the everyday start
    finally:
        if keep_data:
            log(f"data folder kept: {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)
    size_mb = folder_size(bundle_path(dist)) / 1e6
    # The reply names how decode steps ran; a frozen app whose TorchScript could not compile
    # the decode step (its source not shipped) would run every layer in Python, slower.
    ok = (result["returncode"] == 0 and result["reply"] is not None
          and "TorchScript unavailable" not in result["reply"])
    print()
    print("=" * 72)
    print(f"frozen self-test : {'PASS' if ok else 'FAIL'} (exit code {result['returncode']}, "
          f"{result['wall_s']:.1f} s incl. assembling the embedded model on first run)")
    print(f"reply            : {result['reply']}")
    for label, probe in (("first start", cold), ("later start", warm)):
        if probe["ok"]:
            print(f"{label:<17}: window shown after {probe['wall_s']:.2f} s wall "
                  f"({probe['detail'].removeprefix('window shown after ')} in-process)")
        else:
            print(f"{label:<17}: probe failed ({probe.get('returncode')}): {probe['detail']}")
    print(f"bundle size      : {size_mb:.0f} MB ({bundle_path(dist)})")
    print("=" * 72, flush=True)
    if not ok:
        print("--- self-test output (tail) ---")
        print(result["output"], flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the Ferrox Chat app for this platform with PyInstaller (one folder).",
        epilog="See the module docstring (packaging/build.py) for the outputs and what "
               "--self-test measures.")
    parser.add_argument("--self-test", action="store_true",
                        help="after building, run the frozen app's --self-test offscreen and "
                             "report the reply, start-up time and bundle size")
    parser.add_argument("--no-build", action="store_true",
                        help="skip PyInstaller (use the existing build in --dist)")
    parser.add_argument("--install-deps", action="store_true",
                        help="pip install -r packaging/requirements-build.txt first")
    parser.add_argument("--clean", action="store_true",
                        help="clear PyInstaller's cache and the work folder first")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist",
                        help="output folder (default: dist/)")
    parser.add_argument("--work", type=Path, default=ROOT / "build",
                        help="PyInstaller's work folder (default: build/)")
    parser.add_argument("--keep-test-data", action="store_true",
                        help="keep the self-test's temporary data folder")
    args = parser.parse_args(argv)
    dist, work = args.dist.resolve(), args.work.resolve()

    if args.install_deps:
        run([sys.executable, "-m", "pip", "install", "-r",
             str(PACKAGING / "requirements-build.txt")])
    if not args.no_build:
        elapsed = build(dist, work, args.clean)
        size_mb = folder_size(bundle_path(dist)) / 1e6
        log(f"built {bundle_path(dist)} in {elapsed:.0f} s; {size_mb:.0f} MB")
    if args.self_test:
        return self_test(dist, args.keep_test_data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
