"""Opening the chat database: where it lives, the connection settings, and schema migrations.

The database is one SQLite file, `ferrox.sqlite3` in the data directory, in WAL mode with
`synchronous=NORMAL`: a commit appends to the write-ahead log without an fsync, so it is cheap
enough to make every ~1 s while a reply streams, and it survives the app crashing or being
killed (the log is replayed on the next open). Only a power cut can lose the last commits, and
even then the file stays consistent.

Opening never deletes or rewrites a file it does not understand: a file that is not SQLite, is
damaged, or comes from a newer Ferrox Chat is refused with a StorageError and left untouched.
A damaged one (UnreadableDatabase) is renamed aside only when the person chooses to
(`set_aside`), never deleted.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Sequence

from app.paths import data_dir
from app.storage.errors import StorageError, sqlite_errors_as_storage_errors
from app.storage.migrations import MIGRATIONS, Migration

DB_FILENAME = "ferrox.sqlite3"
BUSY_TIMEOUT_S = 5.0  # how long a write waits for another process's write to finish


def database_path(location: str | os.PathLike | None = None) -> Path:
    """None -> `data_dir()/ferrox.sqlite3`; an existing directory -> that directory's
    `ferrox.sqlite3`; anything else is the database file's own path."""
    if location is None:
        return data_dir() / DB_FILENAME
    path = Path(location).expanduser()
    return path / DB_FILENAME if path.is_dir() else path


def open_database(path: Path, migrations: Sequence[Migration] = MIGRATIONS) -> sqlite3.Connection:
    """A configured connection to `path`, migrated to `len(migrations)`; StorageError if not.

    The connection is in autocommit mode (`isolation_level=None`): callers open transactions
    themselves with BEGIN IMMEDIATE. It may be used from any thread, one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite_errors_as_storage_errors(path):
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
    try:
        with sqlite_errors_as_storage_errors(path):
            _refuse_foreign_file(conn, path, len(migrations))
            _configure(conn)
            migrate(conn, path, migrations)
    except BaseException:
        conn.close()
        raise
    return conn


def set_aside(path: Path, target: Path | None = None) -> Path:
    """Rename an unreadable database (and its journal files) to `target` (by default
    `set_aside_name(path)`: `<name>.damaged-<time>` in the same folder), keeping it for a
    later rescue; the next open starts an empty one. Returns the new name; StorageError when
    it cannot be renamed."""
    target = target or set_aside_name(path)
    try:
        for suffix in ("-wal", "-shm", "-journal"):
            extra = path.with_name(path.name + suffix)
            if extra.exists():
                extra.rename(target.with_name(target.name + suffix))
        path.rename(target)
    except OSError as exc:
        raise StorageError(f"{path} could not be set aside ({exc.strerror or exc}); move it "
                           "elsewhere by hand to start with an empty chat history.") from None
    return target


def set_aside_name(path: Path) -> Path:
    """Where `set_aside` would put `path` now."""
    return path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")


def schema_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


def _refuse_foreign_file(conn: sqlite3.Connection, path: Path, known_version: int) -> None:
    # Runs before anything writes: reading the header is what detects a non-SQLite file.
    version = schema_version(conn)
    if version > known_version:
        raise StorageError(
            f"{path} was saved by a newer version of Ferrox Chat (database version {version}; "
            f"this version reads up to {known_version}). Update Ferrox Chat to open it; "
            "the file was left as it is.")
    if version == 0 and _has_tables(conn):
        raise StorageError(
            f"{path} is an SQLite database, but not a Ferrox Chat one. It was left as it is; "
            "move it elsewhere or choose another data directory.")


def _has_tables(conn: sqlite3.Connection) -> bool:
    row = conn.execute("SELECT count(*) FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchone()
    return row[0] > 0


def _configure(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    # Unicode-aware case folding for search: SQLite's own LIKE/lower() fold ASCII only.
    conn.create_function("casefold", 1, _casefold, deterministic=True)


def _casefold(text: str | None) -> str | None:
    return text.casefold() if isinstance(text, str) else text


def migrate(conn: sqlite3.Connection, path: Path, migrations: Sequence[Migration]) -> None:
    """Run the migrations the database has not had yet, each in its own transaction."""
    for target in range(schema_version(conn) + 1, len(migrations) + 1):
        try:
            _run_migration(conn, migrations[target - 1], target)
        except (StorageError, sqlite3.Error):
            raise  # already plain, or made plain by the caller (e.g. a full disk)
        except Exception as error:
            raise StorageError(
                f"Upgrading {path} to database version {target} failed ({error}); "
                f"it was left at version {target - 1}.") from error


def _run_migration(conn: sqlite3.Connection, migration: Migration, target: int) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Re-read under the write lock: another process may have migrated meanwhile.
        if schema_version(conn) == target - 1:
            migration(conn)
            conn.execute(f"PRAGMA user_version = {int(target)}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
