"""Uploaded files (``POST /v1/files``): their records in the store, and the refusal to delete one a job still needs.

The bytes live under the uploads directory (``Settings.uploads_dir``, a data root), one directory per file:
``file-<hex>/<name>``, so a spec names an upload by its id (``data: {path: file-<hex>}``).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from service.queue.db import Database, cursor_seq, remember_deleted
from service.queue.status import JobStatus
from service.queue.store import storable

# A job in one of these will read its data again (a paused or interrupted one when it resumes).
USING_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED, JobStatus.INTERRUPTED)


class FileNotFound(LookupError):
    """No uploaded file with that id."""

    def __init__(self, file_id: str) -> None:
        super().__init__(f"No file with id {file_id!r}; GET /v1/files lists them.")
        self.file_id = file_id


class FileInUse(Exception):
    """A job that has not finished names the file."""

    def __init__(self, file_id: str, job_ids: list[str]) -> None:
        super().__init__(
            f"File {file_id} is used by {', '.join(job_ids)} (queued, running, paused or interrupted); "
            "cancel those jobs or wait for them to finish, then delete it."
        )
        self.file_id, self.job_ids = file_id, job_ids


@dataclass(frozen=True)
class FileRecord:
    """One row of ``files``."""

    seq: int
    id: str
    filename: str
    purpose: str
    bytes: int
    sha256: str
    path: str  # relative to the uploads directory
    format: str | None
    rows: int | None
    created_at: float
    rules_version: int | None  # the upload rules (uploads/rows.py RULES_VERSION) that checked it; None: none
    rules_problem: str | None  # JSON {row, field, message}: the first row those rules refuse; None: it passed

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> FileRecord:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


class FileStore:
    """The ``files`` table, on the job store's database (one SQLite file, one schema).

    Example:
        files = FileStore(store.db)
        record = files.add(file_id="file-ab12", filename="train.jsonl", purpose="fine-tune", ...)
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(
        self,
        *,
        file_id: str,
        filename: str,
        purpose: str,
        size: int,
        sha256: str,
        path: str,
        format: str | None,
        rows: int | None,
        rules_version: int | None,
    ) -> FileRecord:
        """Record a file whose bytes are in place; ``rules_version``: the upload rules its rows passed (None for
        a file kept as sent)."""
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT INTO files (id, filename, purpose, bytes, sha256, path, format, rows, created_at,"
                " rules_version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (file_id, filename, purpose, size, sha256, path, format, rows, time.time(), rules_version),
            )
            return self._get(conn, file_id)

    def record_check(
        self, file_id: str, *, rules_version: int, format: str | None, rows: int | None, problem: str | None
    ) -> FileRecord:
        """Record what a later run of the upload rules (version ``rules_version``) found: the rows' layout and
        count where they pass, ``problem`` (JSON) where they do not. ``FileNotFound`` if it was deleted meanwhile."""
        with self.db.transaction() as conn:
            self._get(conn, file_id)
            if problem is None:
                conn.execute(
                    "UPDATE files SET rules_version = ?, format = ?, rows = ?, rules_problem = NULL WHERE id = ?",
                    (rules_version, format, rows, file_id),
                )
            else:  # the layout it had stays: the answer still says what was uploaded, and why it no longer trains
                conn.execute(
                    "UPDATE files SET rules_version = ?, rules_problem = ? WHERE id = ?",
                    (rules_version, problem, file_id),
                )
            return self._get(conn, file_id)

    def get(self, file_id: str) -> FileRecord:
        """The file, or ``FileNotFound``."""
        return self._get(self.db.conn, file_id)

    def list(
        self, *, purpose: str | None = None, after: str | None = None, limit: int = 100
    ) -> tuple[list[FileRecord], bool]:
        """Newest first, as OpenAI lists files; ``after`` is the last id of the previous page. Returns
        ``(files, has_more)``."""
        where, args = ["1=1"], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:  # a deleted file's place is kept: the page starts at the next one
            seq = cursor_seq(self.db.conn, "files", after)
            if seq is None:
                raise FileNotFound(after)
            where.append("seq < ?")
            args.append(seq)
        rows = self.db.conn.execute(
            f"SELECT * FROM files WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT ?", (*args, limit + 1)
        ).fetchall()
        return [FileRecord.from_row(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, file_id: str, *, directory: Path) -> FileRecord:
        """Forget the file unless a job that has not finished names ``directory`` (its resolved place) in its
        resolved spec; raises ``FileInUse`` then. The caller removes the bytes.

        A job being created at the same time cannot slip past: ``JobStore.create_job`` checks, in its own
        write transaction, that the uploads its spec names are still recorded; the two transactions are
        serialised, so the job is refused or this delete sees it."""
        # As the stored spec's JSON holds the path (json.dumps without ASCII escapes, then storable): the file
        # itself, or inside it. Escaped, a data directory named in other than ASCII never matched.
        quoted = storable(json.dumps(str(directory), ensure_ascii=False))
        statuses = [s.value for s in USING_STATUSES]
        with self.db.transaction() as conn:
            record = self._get(conn, file_id)
            users = conn.execute(
                f"SELECT id FROM jobs WHERE status IN ({','.join('?' * len(statuses))})"
                " AND (instr(spec_json, ?) > 0 OR instr(spec_json, ?) > 0) ORDER BY seq",
                (*statuses, quoted, quoted[:-1] + "/"),
            ).fetchall()
            if users:
                raise FileInUse(file_id, [row["id"] for row in users])
            conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
            remember_deleted(conn, file_id, record.seq)
            return record

    @staticmethod
    def _get(conn: sqlite3.Connection, file_id: str) -> FileRecord:
        row = conn.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise FileNotFound(file_id)
        return FileRecord.from_row(row)
