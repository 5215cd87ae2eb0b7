"""The durable job store: jobs, their events, and the one function that changes a job's status."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jobs.events import (
    CacheProgressEvent,
    CheckpointEvent,
    ErrorCode,
    FailedEvent,
    FinishedEvent,
    JobEvent,
    StartedEvent,
    StepEvent,
    event_to_wire,
    parse_job_event,
)
from service.queue.db import Database, create_schema, remember_deleted
from service.queue.events import JobError, StatusEvent, StopRequestedEvent, parse_stored_event
from service.queue.records import EventRecord, JobRecord
from service.queue.retention import StepRetention, compact_steps
from service.queue.status import FINISHED, IllegalTransition, JobStatus, check_transition, deletion_refused_message
from service.queue.stored_json import stored_json

# Columns a transition may set besides status; everything else is derived in `_transition`.
_TRANSITION_FIELDS = frozenset({"worker", "device", "error_code", "error_message"})


def storable(text: str) -> str:
    """``text`` as it can be stored and served: a lone surrogate (from an undecodable file name in an error
    message, say) becomes ``?``. Stored as is, it would make every answer that shows the record a 500."""
    return text.encode("utf-8", "replace").decode("utf-8")


class JobNotFound(LookupError):
    """No job with that id."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"No job with id {job_id!r}.")
        self.job_id = job_id


class QueueFull(Exception):
    """The queue already holds ``max_queued_jobs``."""


class UploadsGone(Exception):
    """Uploaded files the spec names were deleted before the job could be stored."""

    def __init__(self, file_ids: list[str]) -> None:
        super().__init__(
            f"{', '.join(file_ids)} {'was' if len(file_ids) == 1 else 'were'} deleted while the job was being "
            "submitted; upload the data again and submit with its new id."
        )
        self.file_ids = file_ids


class IdempotencyConflict(Exception):
    """An ``Idempotency-Key`` reused with a different request body."""


class JobStore:
    """Jobs and events in one SQLite file. Safe to share between threads and processes.

    Example:
        store = JobStore(settings.db_path)
        job, created = store.create_job(job_id="job-1", name=None, spec_text=text, spec={...})
        store.transition(job.id, JobStatus.CANCELLED, reason="cancelled by user")
    """

    def __init__(self, path: Path, *, busy_timeout_s: float | None = None) -> None:
        create_schema(path, busy_timeout_s)
        self.db = Database(path, busy_timeout_s)  # None: FERRY_DB_BUSY_TIMEOUT_S, else 30 s (db.py)

    def close(self) -> None:
        """Close this process's connections to the file."""
        self.db.close()

    # -- jobs -------------------------------------------------------------------------------------------

    def create_job(
        self,
        *,
        job_id: str,
        name: str | None,
        spec_text: str,
        spec: dict[str, Any],
        total_steps: int | None = None,
        idempotency_key: str | None = None,
        request_sha256: str | None = None,
        max_queued: int | None = None,
        uploads: Iterable[str] = (),
    ) -> tuple[JobRecord, bool]:
        """Queue a new job; returns ``(job, created)``. A repeated idempotency key returns the first job.

        ``uploads``: the ids of the uploaded files the spec names. Each must still be recorded, checked in this
        write transaction (``UploadsGone`` if not): a delete of one (``FileStore.delete``) is serialised with
        it, so either the job is refused here or the delete sees the job and refuses.
        """
        now = time.time()
        needed = sorted(set(uploads))
        with self.db.transaction() as conn:
            if idempotency_key is not None:
                existing = conn.execute("SELECT * FROM jobs WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
                if existing is not None:
                    if existing["request_sha256"] != request_sha256:
                        raise IdempotencyConflict(idempotency_key)
                    return JobRecord.from_row(existing), False
            if max_queued is not None and self._count(conn, JobStatus.QUEUED) >= max_queued:
                raise QueueFull(max_queued)
            if needed:
                placeholders = ",".join("?" * len(needed))
                kept = {r["id"] for r in conn.execute(f"SELECT id FROM files WHERE id IN ({placeholders})", needed)}
                if missing := [file_id for file_id in needed if file_id not in kept]:
                    raise UploadsGone(missing)
            conn.execute(
                "INSERT INTO jobs (id, name, status, spec_text, spec_json, total_steps, idempotency_key,"
                " request_sha256, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    name,
                    JobStatus.QUEUED.value,
                    storable(spec_text),
                    storable(json.dumps(spec, ensure_ascii=False)),
                    total_steps,
                    idempotency_key,
                    request_sha256,
                    now,
                    now,
                ),
            )
            self._insert_event(
                conn, job_id, 0, StatusEvent(status=JobStatus.QUEUED, previous=None, reason="submitted"), now
            )
            return self._get(conn, job_id), True

    def get_job(self, job_id: str) -> JobRecord:
        """The job, or ``JobNotFound``."""
        return JobRecord.from_row(self.get_job_row(job_id))

    def get_job_row(self, job_id: str) -> sqlite3.Row:
        """The job's row as stored (``JobRecord.from_row`` reads it), or ``JobNotFound``."""
        row = self.db.conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return row

    def list_jobs(
        self, *, statuses: Iterable[JobStatus] | None = None, before: int | None = None, limit: int = 50
    ) -> tuple[list[JobRecord], int | None]:
        """Newest first. ``before`` is the cursor from the previous page; returns ``(jobs, next_cursor)``."""
        rows, next_cursor = self.list_job_rows(statuses=statuses, before=before, limit=limit)
        return [JobRecord.from_row(r) for r in rows], next_cursor

    def list_job_rows(
        self, *, statuses: Iterable[JobStatus] | None = None, before: int | None = None, limit: int = 50
    ) -> tuple[list[sqlite3.Row], int | None]:
        """``list_jobs``, as the stored rows."""
        where, args = ["1=1"], []
        if statuses:
            values = [s.value for s in statuses]
            where.append(f"status IN ({','.join('?' * len(values))})")
            args += values
        if before is not None:
            where.append("seq < ?")
            args.append(before)
        rows = self.db.conn.execute(
            f"SELECT * FROM jobs WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT ?", (*args, limit + 1)
        ).fetchall()
        return rows[:limit], (rows[limit - 1]["seq"] if len(rows) > limit else None)

    def jobs_with_status(self, status: JobStatus) -> list[JobRecord]:
        """Every job in ``status``, oldest first."""
        rows = self.db.conn.execute("SELECT * FROM jobs WHERE status = ? ORDER BY seq", (status.value,))
        return [JobRecord.from_row(r) for r in rows]

    def count_by_status(self) -> dict[JobStatus, int]:
        """How many jobs are in each status (zeros included)."""
        counts = {s: 0 for s in JobStatus}
        for row in self.db.conn.execute("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status"):
            counts[JobStatus(row["status"])] = row["n"]
        return counts

    def delete_job(self, job_id: str) -> JobRecord:
        """Delete a finished job and its events; refuses (``IllegalTransition``) any other."""
        with self.db.transaction() as conn:
            job = self._get(conn, job_id)
            if job.status not in FINISHED:
                raise IllegalTransition(job_id, job.status, job.status, deletion_refused_message(job_id, job.status))
            conn.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
            conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            remember_deleted(conn, job_id, job.seq)
            return job

    # -- the lifecycle ---------------------------------------------------------------------------------

    def transition(self, job_id: str, target: JobStatus, *, reason: str, **fields: Any) -> JobRecord:
        """Change a job's status in one transaction, refusing what ``status.ALLOWED`` does not allow."""
        with self.db.transaction() as conn:
            return self._transition(conn, job_id, target, reason=reason, **fields)

    def claim_next(self, *, worker: str, device: str | None) -> JobRecord | None:
        """Move the oldest queued job to running on ``worker``; None when the queue is empty."""
        with self.db.transaction() as conn:
            row = conn.execute("SELECT id FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1").fetchone()
            if row is None:
                return None
            return self._transition(
                conn, row["id"], JobStatus.RUNNING, reason=f"started on {worker}", worker=worker, device=device
            )

    def cancel(self, job_id: str) -> JobRecord:
        """Cancel now, or ask a running job's process to stop (the scheduler enforces it)."""
        return self._stop_or_transition(job_id, "cancel", JobStatus.CANCELLED, "cancelled by user")

    def pause(self, job_id: str) -> JobRecord:
        """Pause a queued job now, or ask a running one to checkpoint and exit."""
        return self._stop_or_transition(job_id, "pause", JobStatus.PAUSED, "paused by user")

    def resume(self, job_id: str) -> JobRecord:
        """Queue a paused, interrupted or failed job again; it continues from its last checkpoint.

        A resume by hand starts the automatic retries afresh: the user has looked at the job, and its next
        crash should not fail it at once for the retries an earlier run used up.
        """
        with self.db.transaction() as conn:
            self._transition(conn, job_id, JobStatus.QUEUED, reason="resumed by user")
            conn.execute("UPDATE jobs SET retries = 0 WHERE id = ?", (job_id,))
            return self._get(conn, job_id)

    def requeue_interrupted(self, job_id: str, *, max_retries: int, count_retry: bool = True) -> JobRecord:
        """An interrupted job goes back to the queue while retries remain, else it fails.

        ``count_retry=False`` for an orderly server shutdown, which is no fault of the job's.
        """
        with self.db.transaction() as conn:
            job = self._get(conn, job_id)
            if not count_retry:
                return self._transition(conn, job_id, JobStatus.QUEUED, reason="requeued after a server shutdown")
            if job.retries >= max_retries:
                return self._transition(
                    conn,
                    job_id,
                    JobStatus.FAILED,
                    reason="interrupted too often",
                    error_code=ErrorCode.INTERRUPTED,
                    error_message=f"The job was interrupted {job.retries + 1} times; the limit is "
                    f"{max_retries} automatic retries (FERRY_MAX_RETRIES). Resume it by hand.",
                )
            conn.execute("UPDATE jobs SET retries = retries + 1 WHERE id = ?", (job_id,))
            return self._transition(conn, job_id, JobStatus.QUEUED, reason="requeued after an interruption")

    def set_process(self, job_id: str, *, pid: int | None, started_at: float | None) -> None:
        """Record the process running the job (not a status change)."""
        self.db.conn.execute("UPDATE jobs SET pid = ?, pid_started_at = ? WHERE id = ?", (pid, started_at, job_id))

    def register_process(self, job_id: str, attempt: int, *, pid: int, started_at: float | None) -> bool:
        """A job's own process records itself before it touches anything, if the attempt is still running
        and still its own; False when a restarted server has taken the job back (the process must not run)."""
        cursor = self.db.conn.execute(
            "UPDATE jobs SET pid = ?, pid_started_at = ? WHERE id = ? AND attempt = ? AND status = ?",
            (pid, started_at, job_id, attempt, JobStatus.RUNNING.value),
        )
        return cursor.rowcount == 1

    def _stop_or_transition(self, job_id: str, kind: str, target: JobStatus, reason: str) -> JobRecord:
        with self.db.transaction() as conn:
            job = self._get(conn, job_id)
            if job.status is not JobStatus.RUNNING:
                return self._transition(conn, job_id, target, reason=reason)
            if job.stop_request != "cancel":  # a cancel is never downgraded to a pause
                conn.execute(
                    "UPDATE jobs SET stop_request = ?, updated_at = ? WHERE id = ?", (kind, time.time(), job_id)
                )
                self._insert_event(conn, job_id, job.attempt, StopRequestedEvent(kind=kind))  # type: ignore[arg-type]
            return self._get(conn, job_id)

    def _transition(
        self, conn: sqlite3.Connection, job_id: str, target: JobStatus, *, reason: str, **fields: Any
    ) -> JobRecord:
        """The only code that writes ``jobs.status``. Call inside a transaction."""
        assert set(fields) <= _TRANSITION_FIELDS, f"unexpected transition fields {set(fields)}"
        if fields.get("error_code") is not None:
            fields["error_code"] = ErrorCode(fields["error_code"]).value  # only a declared code is stored
        if fields.get("error_message") is not None:
            fields["error_message"] = storable(fields["error_message"])
        job = self._get(conn, job_id)
        check_transition(job_id, job.status, target)
        now = time.time()
        changes: dict[str, Any] = {"status": target.value, "updated_at": now, "stop_request": None, **fields}
        if target is JobStatus.RUNNING:
            changes.update(
                attempt=job.attempt + 1,
                started_at=job.started_at or now,
                finished_at=None,
                error_code=fields.get("error_code"),
                error_message=fields.get("error_message"),
            )
        else:
            changes.update(pid=None, pid_started_at=None)
        if target in FINISHED:
            changes["finished_at"] = now
        if target is JobStatus.QUEUED:
            changes.update(worker=None, device=None, finished_at=None, error_code=None, error_message=None)
        assignments = ", ".join(f"{column} = ?" for column in changes)
        conn.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*changes.values(), job_id))
        error = None
        if fields.get("error_message"):
            code = ErrorCode(fields.get("error_code") or ErrorCode.TRAINING_ERROR)
            error = JobError(code=code, message=fields["error_message"])
        event = StatusEvent(status=target, previous=job.status, reason=reason, error=error)
        self._insert_event(conn, job_id, changes.get("attempt", job.attempt), event, now)
        return self._get(conn, job_id)

    # -- events ----------------------------------------------------------------------------------------

    def append_event(self, job_id: str, attempt: int, event: JobEvent | dict[str, Any]) -> int:
        """Store a job's event (typed, or its wire form from a child process) and keep its latest step,
        checkpoint and length on the job. An event jobs/events.py does not declare is refused."""
        return self.append_events(job_id, attempt, [event])[-1]

    def append_events(self, job_id: str, attempt: int, events: list[JobEvent | dict[str, Any]]) -> list[int]:
        """``append_event`` for several events in one transaction (a job's steps arrive in small batches)."""
        typed = [e if isinstance(e, JobEvent) else parse_job_event(e) for e in events]
        with self.db.transaction() as conn:
            ids = [self._insert_event(conn, job_id, attempt, event) for event in typed]
            # A cache job's progress events count samples encoded, as steps count optimizer steps.
            steps = [e for e in typed if isinstance(e, StepEvent | CacheProgressEvent)]
            if steps:  # the latest only: the job row shows the newest step
                latest = stored_json({**event_to_wire(steps[-1]), "reported_at": time.time()})  # for the finish time
                conn.execute("UPDATE jobs SET progress_json = ? WHERE id = ?", (storable(latest), job_id))
            for event in typed:
                if isinstance(event, CheckpointEvent):
                    conn.execute(
                        "UPDATE jobs SET checkpoint_json = ? WHERE id = ?", (storable(event.model_dump_json()), job_id)
                    )
                elif isinstance(event, StartedEvent):
                    conn.execute("UPDATE jobs SET total_steps = ? WHERE id = ?", (event.total_steps, job_id))
            return ids

    def compact_steps(self, job_id: str, after_id: int, retention: StepRetention) -> int:
        """Apply the step-event retention to the job's complete windows (retention.py); returns the new mark."""
        with self.db.transaction() as conn:
            return compact_steps(conn, job_id, after_id, retention)

    def list_events(
        self,
        job_id: str,
        *,
        after: int = 0,
        limit: int = 100,
        types: Iterable[str] | None = None,
        exclude_types: Iterable[str] | None = None,
    ) -> list[EventRecord]:
        """Events with id > ``after``, oldest first; only ``types``, or all but ``exclude_types``."""
        sql, args = "SELECT * FROM events WHERE job_id = ? AND id > ?", [job_id, after]
        for names, operator in ((types, "IN"), (exclude_types, "NOT IN")):
            if names:
                names = list(names)
                sql += f" AND type {operator} ({','.join('?' * len(names))})"
                args += names
        rows = self.db.conn.execute(sql + " ORDER BY id LIMIT ?", (*args, limit)).fetchall()
        return [EventRecord.from_row(r) for r in rows]

    def last_outcome(self, job_id: str, attempt: int) -> FinishedEvent | FailedEvent | None:
        """The ``finished`` or ``failed`` event the job's process sent in ``attempt``, if any."""
        row = self.db.conn.execute(
            "SELECT * FROM events WHERE job_id = ? AND attempt = ? AND type IN ('finished', 'failed')"
            " ORDER BY id DESC LIMIT 1",
            (job_id, attempt),
        ).fetchone()
        if row is None:
            return None
        outcome = parse_stored_event(json.loads(row["data"]))  # reads codes stored before the contract too
        assert isinstance(outcome, FinishedEvent | FailedEvent)
        return outcome

    # -- helpers ---------------------------------------------------------------------------------------

    @staticmethod
    def _get(conn: sqlite3.Connection, job_id: str) -> JobRecord:
        row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return JobRecord.from_row(row)

    @staticmethod
    def _count(conn: sqlite3.Connection, status: JobStatus) -> int:
        return conn.execute("SELECT COUNT(*) FROM jobs WHERE status = ?", (status.value,)).fetchone()[0]

    @staticmethod
    def _insert_event(
        conn: sqlite3.Connection,
        job_id: str,
        attempt: int,
        event: JobEvent | StatusEvent | StopRequestedEvent,
        now: float | None = None,
    ) -> int:
        data = event.model_dump(mode="json")
        cursor = conn.execute(
            "INSERT INTO events (job_id, attempt, type, created_at, data) VALUES (?, ?, ?, ?, ?)",
            (job_id, attempt, data["type"], now or time.time(), storable(stored_json(data))),
        )
        return int(cursor.lastrowid)
