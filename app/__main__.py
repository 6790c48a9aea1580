"""`python -m app` / `ferrox-chat`: subcommands run headless; no subcommand starts the GUI."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from app.cli import COMMANDS, build_parser, run_command

    if argv and argv[0] in COMMANDS:
        return run_command(build_parser().parse_args(argv))
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    from app.main import run_gui

    return run_gui(argv)


if __name__ == "__main__":
    sys.exit(main())
