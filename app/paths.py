"""Where Ferrox Chat keeps its files: one place decides the data directory.

Order: an explicit `--data-dir`, then the FERROX_DATA_DIR environment variable, then
platformdirs' user data directory (e.g. ~/.local/share/ferrox-chat on Linux,
~/Library/Application Support/ferrox-chat on macOS, %LOCALAPPDATA%\\ferrox-chat on Windows).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from platformdirs import user_data_dir

APP_DIR_NAME = "ferrox-chat"


def bundle_dir() -> Path | None:
    """The folder a frozen (PyInstaller) build unpacks its data into, sys._MEIPASS; None when
    running from source."""
    bundle = getattr(sys, "_MEIPASS", None)
    return Path(bundle) if bundle else None


def data_dir(override: str | os.PathLike | None = None) -> Path:
    chosen = override or os.environ.get("FERROX_DATA_DIR") or user_data_dir(APP_DIR_NAME, appauthor=False)
    path = Path(chosen).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def use_data_dir(override: str | os.PathLike | None) -> Path:
    """The command line's `--data-dir`, for the whole process: it becomes what every later
    `data_dir()` returns, so what the engine finds on its own (the kernel-policy and weight
    caches) sits beside the chats instead of in the default folder. Set through
    FERROX_DATA_DIR, the one setting every `data_dir()` already reads."""
    folder = data_dir(override)
    if override:
        os.environ["FERROX_DATA_DIR"] = str(folder)
    return folder


def models_dir(override: str | os.PathLike | None = None) -> Path:
    path = data_dir(override) / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
