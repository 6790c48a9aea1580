"""Schema migrations, in order: MIGRATIONS[i] takes a database from version i to i + 1.

`PRAGMA user_version` holds how many have run. To change the schema, append a function; never
edit one that has shipped, since databases in the field have already run it. The runner
(`database.migrate`) calls each inside its own transaction and bumps the version in the same
transaction, so a migration must not commit and must not use `executescript` (which commits).
"""

from __future__ import annotations

import sqlite3
from typing import Callable

Migration = Callable[[sqlite3.Connection], None]

# Timestamps are Unix seconds (REAL). JSON columns hold an object, '{}' when empty.
# Message ids grow with creation, so "ordered by creation" is "ordered by id".
_V1_STATEMENTS = (
    """CREATE TABLE chats (
        id              INTEGER PRIMARY KEY,
        title           TEXT    NOT NULL,
        created_at      REAL    NOT NULL,
        updated_at      REAL    NOT NULL,
        pinned          INTEGER NOT NULL DEFAULT 0,
        deleted_at      REAL,
        model           TEXT,
        settings        TEXT    NOT NULL DEFAULT '{}',
        head_message_id INTEGER REFERENCES messages(id) ON DELETE SET NULL
    )""",
    """CREATE TABLE messages (
        id          INTEGER PRIMARY KEY,
        chat_id     INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
        parent_id   INTEGER REFERENCES messages(id) ON DELETE CASCADE,
        role        TEXT    NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content     TEXT    NOT NULL DEFAULT '',
        status      TEXT    NOT NULL DEFAULT 'complete'
                    CHECK (status IN ('complete', 'streaming', 'stopped', 'error', 'interrupted')),
        error       TEXT,
        created_at  REAL    NOT NULL,
        updated_at  REAL    NOT NULL,
        metadata    TEXT    NOT NULL DEFAULT '{}'
    )""",
    "CREATE INDEX messages_by_chat ON messages(chat_id)",
    "CREATE INDEX messages_by_parent ON messages(parent_id)",
    "CREATE INDEX messages_streaming ON messages(status) WHERE status = 'streaming'",
    """CREATE TABLE attachments (
        id          INTEGER PRIMARY KEY,
        message_id  INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        name        TEXT    NOT NULL,
        kind        TEXT    NOT NULL,
        text        TEXT    NOT NULL DEFAULT '',
        token_count INTEGER NOT NULL DEFAULT 0,
        size_bytes  INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX attachments_by_message ON attachments(message_id)",
    """CREATE TABLE models (
        id             INTEGER PRIMARY KEY,
        path           TEXT    NOT NULL UNIQUE,
        name           TEXT    NOT NULL,
        architecture   TEXT,
        size_bytes     INTEGER,
        quantization   TEXT,
        context_length INTEGER,
        added_at       REAL    NOT NULL,
        defaults       TEXT    NOT NULL DEFAULT '{}'
    )""",
    """CREATE TABLE app_settings (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
)


def _v1_create_tables(conn: sqlite3.Connection) -> None:
    for statement in _V1_STATEMENTS:
        conn.execute(statement)


def _v2_create_connections(conn: sqlite3.Connection) -> None:
    # Remote servers (app/storage/connections.py). No API key column: keys live in the OS
    # keychain under key_ref, or in the environment variable api_key_env names.
    conn.execute("""CREATE TABLE connections (
        id                INTEGER PRIMARY KEY,
        name              TEXT    NOT NULL UNIQUE,
        base_url          TEXT    NOT NULL,
        session_header    TEXT    NOT NULL DEFAULT 'X-Session-ID',
        api_key_env       TEXT,
        extended_sampling INTEGER NOT NULL DEFAULT 1,
        context_sizes     TEXT    NOT NULL DEFAULT '{}',
        key_ref           TEXT    NOT NULL UNIQUE,
        created_at        REAL    NOT NULL
    )""")


def _v3_attachment_sources(conn: sqlite3.Connection) -> None:
    # The sha256 of the file an attachment was read from, set when the document was indexed
    # for retrieval (app/retrieval keys its index by it); NULL for documents sent whole.
    conn.execute("ALTER TABLE attachments ADD COLUMN sha256 TEXT")


MIGRATIONS: tuple[Migration, ...] = (
    _v1_create_tables,
    _v2_create_connections,
    _v3_attachment_sources,
)
