"""The one error type the storage layer raises, and the one place sqlite errors become it.

Callers (the GUI, the CLI) show `str(error)` as it is, so every message is a plain sentence
that says what happened and what is safe -- never a sqlite traceback.
"""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class StorageError(Exception):
    """Chats, models or settings cannot be read or saved; the message says why in plain words."""


class UnreadableDatabase(StorageError):
    """The chat database file is not an SQLite database or is damaged (`path`): it can be set
    aside (`database.set_aside`) to start with an empty chat history, keeping it."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


@contextmanager
def sqlite_errors_as_storage_errors(path: Path) -> Iterator[None]:
    """Turn any sqlite3 error raised inside into a StorageError a person can read."""
    try:
        yield
    except sqlite3.Error as error:
        message = describe_sqlite_error(error, path)
        if _unreadable(error):
            raise UnreadableDatabase(message, path) from error
        raise StorageError(message) from error


def _unreadable(error: sqlite3.Error) -> bool:
    text = str(error).lower()
    return "not a database" in text or "malformed" in text or "file is encrypted" in text


def describe_sqlite_error(error: sqlite3.Error, path: Path) -> str:
    text = str(error).lower()
    if "database or disk is full" in text:
        return (f"The disk is full, so the last change could not be saved to {path}. "
                "Nothing already saved was lost; free some space and try again.")
    if "database is locked" in text or "database is busy" in text:
        return (f"The chat database {path} is busy: another program (perhaps a second "
                "Ferrox Chat) is writing to it. Try again in a moment.")
    if _unreadable(error):
        return (f"{path} is not a Ferrox Chat database, or it is damaged. It was left as it is; "
                "move it elsewhere to start with an empty chat history.")
    if "unable to open" in text or "readonly" in text or "read-only" in text:
        return f"The chat database {path} cannot be opened for writing ({error})."
    if "disk i/o error" in text:
        return f"The disk reported an error while using {path}. Nothing already saved was lost."
    return f"The chat database {path} reported an error: {error}."
