"""Opening the database: location, connection settings, migrations, and files we refuse."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.paths import data_dir
from app.storage import ChatStore, StorageError, UnreadableDatabase
from app.storage.database import (DB_FILENAME, database_path, open_database, schema_version,
                                  set_aside)
from app.storage.migrations import MIGRATIONS

ROOT = Path(__file__).resolve().parents[2]


def _add_tags_column(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE chats ADD COLUMN tags TEXT NOT NULL DEFAULT '[]'")


def _raw_version(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()


def test_default_location_is_the_data_dir(store):
    assert store.path == data_dir() / DB_FILENAME
    assert store.path.is_file()


def test_location_may_be_a_directory_or_a_file(tmp_path):
    assert database_path(tmp_path) == tmp_path / DB_FILENAME
    assert database_path(tmp_path / "other.db") == tmp_path / "other.db"
    with ChatStore(tmp_path / "nested" / "chats.db") as store:
        assert store.path.is_file()


def test_connection_is_wal_with_foreign_keys_and_normal_sync(tmp_path):
    conn = open_database(tmp_path / DB_FILENAME)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert schema_version(conn) == len(MIGRATIONS)
    finally:
        conn.close()


def test_a_v1_database_upgrades_when_a_migration_is_appended(tmp_path):
    path = tmp_path / DB_FILENAME
    with ChatStore(path) as store:
        chat = store.create_chat("Kept across the upgrade")
        store.add_message(chat.id, "user", "hello")
    assert _raw_version(path) == len(MIGRATIONS)

    conn = open_database(path, (*MIGRATIONS, _add_tags_column))
    try:
        assert schema_version(conn) == len(MIGRATIONS) + 1
        row = conn.execute("SELECT title, tags FROM chats").fetchone()
        assert row == ("Kept across the upgrade", "[]")
    finally:
        conn.close()


def test_a_failing_migration_leaves_the_database_as_it_was(tmp_path):
    path = tmp_path / DB_FILENAME
    ChatStore(path).close()

    def broken(conn):
        conn.execute("CREATE TABLE half_done (x)")
        raise ValueError("boom")

    with pytest.raises(StorageError, match=f"left at version {len(MIGRATIONS)}"):
        open_database(path, (*MIGRATIONS, broken))
    assert _raw_version(path) == len(MIGRATIONS)
    with ChatStore(path) as store:  # still opens at its version, without the half-made table
        tables = {r[0] for r in store._conn.execute("SELECT name FROM sqlite_master")}
        assert "half_done" not in tables


def test_a_database_from_a_newer_version_is_refused_and_untouched(tmp_path):
    path = tmp_path / DB_FILENAME
    ChatStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.close()
    before = path.read_bytes()

    with pytest.raises(StorageError, match="newer version of Ferrox Chat"):
        ChatStore(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("content", [b"this is not a database\n" * 200, b"SQLite format 3\x00" + b"\xff" * 4000])
def test_a_file_that_is_not_a_database_is_refused_and_kept(tmp_path, content):
    path = tmp_path / DB_FILENAME
    path.write_bytes(content)

    with pytest.raises(StorageError) as caught:
        ChatStore(path)
    assert "not a Ferrox Chat database, or it is damaged" in str(caught.value)
    assert "file is not a database" not in str(caught.value)  # sqlite's own words stay out
    assert path.read_bytes() == content


def test_another_programs_sqlite_database_is_refused(tmp_path):
    path = tmp_path / "theirs.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE recipes (name TEXT)")
    conn.commit()
    conn.close()

    with pytest.raises(StorageError, match="not a Ferrox Chat one"):
        ChatStore(path)
    assert _raw_version(path) == 0


def test_a_full_disk_is_a_plain_error_and_loses_nothing_saved(store):
    chat = store.create_chat()
    store.add_message(chat.id, "user", "saved before the disk filled")
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")  # the file may not grow: "disk full"

    with pytest.raises(StorageError) as caught:
        store.add_message(chat.id, "user", "x" * 200_000)
    assert "disk is full" in str(caught.value)
    assert "Nothing already saved was lost" in str(caught.value)
    assert [m.content for m in store.active_path(chat.id)] == ["saved before the disk filled"]
    store.add_message(chat.id, "assistant", "small still fits")  # the store is still usable


def test_a_closed_store_says_so(store):
    store.close()
    store.close()
    with pytest.raises(StorageError, match="closed"):
        store.list_chats()


def test_transaction_is_all_or_nothing(store):
    with pytest.raises(RuntimeError):
        with store.transaction():
            chat = store.create_chat("Half")
            store.add_message(chat.id, "user", "never saved")
            raise RuntimeError("abandon")
    assert store.list_chats() == []


def test_storage_imports_neither_qt_nor_torch():
    code = ("import sys, app.storage; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'PySide6')]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_damaged_database_can_be_set_aside_and_a_fresh_one_opened(tmp_path):
    path = tmp_path / DB_FILENAME
    damaged = b"SQLite format 3\x00" + b"\xff" * 4000
    path.write_bytes(damaged)
    with pytest.raises(UnreadableDatabase) as caught:
        ChatStore(path)
    assert caught.value.path == path
    path.with_name(f"{DB_FILENAME}-wal").write_bytes(b"a log")  # its journal goes with it
    kept = set_aside(path)
    assert kept.parent == path.parent and kept.name.startswith(f"{DB_FILENAME}.damaged-")
    assert kept.read_bytes() == damaged and not path.exists()
    assert kept.with_name(f"{kept.name}-wal").read_bytes() == b"a log"
    with ChatStore(path) as store:
        assert store.list_chats() == []
