"""Entry script of the frozen app (PyInstaller runs this file as __main__).

It does what `ferrox-chat` / `python -m app` do, plus what only a frozen build needs:

- A windowed Windows executable has no console, so sys.stdout/sys.stderr are None there;
  libraries that write to them (logging, uvicorn, warnings) would crash. They go to os.devnull
  instead. (Use ferrox-chat-cli.exe, the console build in the same folder, to see output.)
  Where the streams exist, characters their encoding (a Windows code page) cannot show are
  written as escapes instead of raising UnicodeEncodeError.
"""

from __future__ import annotations

import os
import sys


def _fix_streams() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115
        elif hasattr(stream, "reconfigure"):
            # A Windows console or pipe may use a code page that cannot show every character
            # of a model's reply; print an escape rather than crash on it.
            stream.reconfigure(errors="backslashreplace")


def main() -> int:
    _fix_streams()
    from app.__main__ import main as app_main

    return app_main(sys.argv[1:])


if __name__ == "__main__":
    import multiprocessing

    multiprocessing.freeze_support()
    sys.exit(main())
