"""SQLite connections and the schema, created on every start so a fresh data dir just works."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from time import sleep
from typing import TypeVar

from service.queue.stored_json import stored_json

SCHEMA_VERSION = 1
T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,  -- list order and cursor
    id              TEXT NOT NULL UNIQUE,
    name            TEXT,
    status          TEXT NOT NULL,
    spec_text       TEXT NOT NULL,                      -- as submitted
    spec_json       TEXT NOT NULL,                      -- as resolved by jobs.load_job_spec
    idempotency_key TEXT UNIQUE,
    request_sha256  TEXT,
    total_steps     INTEGER,
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL,
    started_at      REAL,
    finished_at     REAL,
    attempt         INTEGER NOT NULL DEFAULT 0,         -- times it has been launched
    retries         INTEGER NOT NULL DEFAULT 0,         -- automatic requeues after an interruption
    worker          TEXT,
    device          TEXT,
    pid             INTEGER,
    pid_started_at  REAL,                               -- with pid, tells a live process from a reused pid
    stop_request    TEXT,                               -- 'pause' | 'cancel' while the process winds down
    error_code      TEXT,
    error_message   TEXT,
    progress_json   TEXT,                               -- the latest `step` event
    checkpoint_json TEXT                                -- the latest `checkpoint` event
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq);
CREATE TABLE IF NOT EXISTS events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,       -- the cursor and the SSE id
    job_id     TEXT NOT NULL,
    attempt    INTEGER NOT NULL,
    type       TEXT NOT NULL,
    created_at REAL NOT NULL,
    data       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
CREATE INDEX IF NOT EXISTS events_by_job_type ON events (job_id, type, id);
CREATE TABLE IF NOT EXISTS files (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,       -- list order and cursor
    id         TEXT NOT NULL UNIQUE,                    -- file-<hex>, as a spec names it (data.path)
    filename   TEXT NOT NULL,                           -- as uploaded
    purpose    TEXT NOT NULL,
    bytes      INTEGER NOT NULL,
    sha256     TEXT NOT NULL,
    path       TEXT NOT NULL,                           -- under the uploads directory: <id>/<safe name>
    format     TEXT,                                    -- a checked fine-tuning file: 'chat' or 'preference'
    rows       INTEGER,
    created_at REAL NOT NULL,
    rules_version INTEGER,                              -- the upload rules that checked it; NULL: none did
    rules_problem TEXT                                  -- JSON {row, field, message}: how it fails those rules
);
CREATE TABLE IF NOT EXISTS fine_tuning_jobs (
    job_id          TEXT PRIMARY KEY,                   -- the Ferry job it created (jobs.id)
    model           TEXT NOT NULL,
    training_file   TEXT NOT NULL,
    validation_file TEXT,
    suffix          TEXT,
    seed            INTEGER NOT NULL,
    method_json     TEXT NOT NULL,                      -- {type, <type>: {hyperparameters}}, as resolved
    metadata_json   TEXT,
    created_at      REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS deleted_ids (
    id  TEXT PRIMARY KEY,                               -- a deleted job's or file's id (job-<hex>, file-<hex>)
    seq INTEGER NOT NULL                                -- its seq: a list's `after` cursor still pages from it
);
"""


def default_busy_timeout_s() -> float:
    """FERRY_DB_BUSY_TIMEOUT_S (Settings.db_busy_timeout_s, which a job's process inherits), else 30 s."""
    try:
        return max(float(os.environ.get("FERRY_DB_BUSY_TIMEOUT_S", "30")), 0.001)
    except ValueError:
        return 30.0


def is_locked(error: BaseException) -> bool:
    """True for SQLite's "database is locked" / "busy": another connection held the lock past the busy timeout."""
    text = str(error).lower()
    return isinstance(error, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def retry_locked(write: Callable[[], T], *, attempts: int = 4, first_wait_s: float = 0.05) -> T:
    """``write()``, tried again with a doubling wait while the database is locked; the last lock error is raised.

    Each try already waits the busy timeout inside SQLite; the backoff spaces the tries so a lock that is
    released between them is found free."""
    wait = first_wait_s
    for attempt in range(attempts):
        try:
            return write()
        except sqlite3.OperationalError as error:
            if not is_locked(error) or attempt == attempts - 1:
                raise
        sleep(wait)
        wait *= 2
    raise AssertionError("unreachable")


def connect(path: Path, busy_timeout_s: float | None = None) -> sqlite3.Connection:
    """Open ``path`` in WAL mode with autocommit; callers open transactions explicitly."""
    timeout = default_busy_timeout_s() if busy_timeout_s is None else busy_timeout_s
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    # WAL lets the API read while a worker writes events. synchronous=NORMAL in WAL mode never corrupts the
    # file; a power loss can drop only the last few commits, which a resume from checkpoint covers.
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(f"PRAGMA busy_timeout={max(int(timeout * 1000), 1)}")
    return conn


def remember_deleted(conn: sqlite3.Connection, item_id: str, seq: int) -> None:
    """Keep a deleted row's place in its list: ``after=<its id>`` pages on from the next one, as OpenAI does."""
    conn.execute("INSERT OR REPLACE INTO deleted_ids (id, seq) VALUES (?, ?)", (item_id, seq))


def cursor_seq(conn: sqlite3.Connection, table: str, item_id: str) -> int | None:
    """The seq of ``item_id`` in ``table`` (``jobs`` or ``files``), or of the row it was before a delete; None for
    an id never seen. Ids are random, so a list's ``after`` is compared by this seq, never by the id."""
    row = conn.execute(f"SELECT seq FROM {table} WHERE id = ?", (item_id,)).fetchone()
    if row is None:
        row = conn.execute("SELECT seq FROM deleted_ids WHERE id = ?", (item_id,)).fetchone()
    return None if row is None else int(row[0])


def create_schema(path: Path, busy_timeout_s: float | None = None) -> None:
    """Create the data dir, the file and every table if missing; idempotent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = connect(path, busy_timeout_s)
    try:
        conn.executescript(SCHEMA)
        _add_missing_columns(conn)
        conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        _repair_non_finite(conn)
    finally:
        conn.close()


# Columns added after a table was first released: CREATE TABLE IF NOT EXISTS leaves an older database's table as
# it was, so each is added where missing. All are nullable; NULL reads as "not known to this older row".
ADDED_COLUMNS = {"files": (("rules_version", "INTEGER"), ("rules_problem", "TEXT"))}


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    """Add the columns a database made by an older server lacks (a no-op on one made by this version)."""
    conn.execute("BEGIN IMMEDIATE")  # two servers starting on one file at once would add a column twice
    try:
        for table, columns in ADDED_COLUMNS.items():
            present = {row["name"] for row in conn.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns:
                if name not in present:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _repair_non_finite(conn: sqlite3.Connection) -> None:
    """Once per database: rewrite rows an older server stored with a bare ``NaN`` or ``Infinity`` (not JSON:
    SQLite's json functions refuse them) as strict JSON (stored_json.py)."""
    if conn.execute("SELECT 1 FROM meta WHERE key = 'strict_json'").fetchone():
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table, key, column in (("events", "id", "data"), ("jobs", "seq", "progress_json")):
            rows = conn.execute(
                f"SELECT {key}, {column} FROM {table} WHERE {column} IS NOT NULL AND NOT json_valid({column})"
            ).fetchall()
            for row in rows:
                try:
                    fixed = stored_json(json.loads(row[1]))
                except ValueError:  # not JSON even to Python: left as it is, as before
                    continue
                conn.execute(f"UPDATE {table} SET {column} = ? WHERE {key} = ?", (fixed, row[0]))
        conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('strict_json', '1')")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class Database:
    """One connection per thread on one file, plus a ``transaction()`` that takes the write lock up front."""

    def __init__(self, path: Path, busy_timeout_s: float | None = None) -> None:
        self.path, self.busy_timeout_s = path, busy_timeout_s
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    @property
    def conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.path, self.busy_timeout_s)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT: read-check-write with no other writer in between."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.OperationalError:  # e.g. locked: leave no transaction open for this thread's next one
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
        self._local = threading.local()
