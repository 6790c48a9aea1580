"""The connection a store owns, and the two ways to use it: `_read()` and `_write()`.

Thread safety -- one connection, one lock: every call takes a re-entrant lock for its whole
duration, so the GUI thread and a worker thread (say, one saving a streaming reply) can both
write through the same store. Chosen over a connection per thread because SQLite admits one
writer at a time anyway, every call here is short (a streaming update is a sub-millisecond
UPDATE + commit), and one connection gives one place that commits, closes and translates
errors. Other processes (a second app, the CLI) are kept apart by SQLite's own file locks.

Durability: each public call that writes commits before it returns (WAL, synchronous=NORMAL,
see `database.py`); there is no separate commit to forget. `transaction()` groups several
calls into one all-or-nothing write.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from app.storage.database import database_path, open_database
from app.storage.errors import StorageError, sqlite_errors_as_storage_errors


class StoreBase:
    def __init__(self, location: str | os.PathLike | None = None, *,
                 clock: Callable[[], float] = time.time):
        """Open (creating or upgrading) the database. `location`: None for the data directory's
        `ferrox.sqlite3`, a directory to use its `ferrox.sqlite3`, or the file itself.
        `clock` gives Unix seconds; tests pass a fake one."""
        self.path: Path = database_path(location)
        self._clock = clock
        self._lock = threading.RLock()
        self._depth = 0  # nesting of _write() on the thread holding the lock
        self._conn: sqlite3.Connection | None = open_database(self.path)
        self._conn.row_factory = sqlite3.Row

    def close(self) -> None:
        """Close the database; later calls raise StorageError. Safe to call twice."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Make the store calls inside one write: all of them are saved, or (if an exception
        leaves the block) none. Other threads wait until the block ends."""
        with self._write():
            yield

    def _now(self) -> float:
        return float(self._clock())

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StorageError("The chat store is closed.")
        return self._conn

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock, sqlite_errors_as_storage_errors(self.path):
            yield self._connection()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE ... COMMIT); nested uses join the outermost."""
        with self._lock, sqlite_errors_as_storage_errors(self.path):
            conn = self._connection()
            outermost = self._depth == 0
            if outermost:
                conn.execute("BEGIN IMMEDIATE")
            self._depth += 1
            try:
                yield conn
                if outermost:
                    conn.execute("COMMIT")
            except BaseException:
                # SQLite may already have rolled back (e.g. after some disk-full errors).
                if outermost and conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            finally:
                self._depth -= 1

    def _chat_row(self, conn: sqlite3.Connection, chat_id: int) -> sqlite3.Row:
        row = conn.execute("SELECT * FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise StorageError(f"There is no chat with id {chat_id}.")
        return row
