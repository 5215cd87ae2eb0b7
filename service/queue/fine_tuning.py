"""What the OpenAI-compatible fine-tuning API remembers beside the Ferry job it created, and its newest-first reads.

The job itself is an ordinary row of ``jobs`` (same queue, same status machine); ``fine_tuning_jobs`` keeps what
the request named (model, files, suffix, seed, method) so the answers can show it. A listing joins the two, so
a record whose job was never created (a crash between the two writes) or was deleted is never shown.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from service.queue.db import Database, cursor_seq
from service.queue.records import EventRecord, JobRecord
from service.queue.store import JobNotFound
from service.queue.stored_json import finite

# The job's columns and the request's; the request's time under its own name (both tables have created_at).
_SELECT = (
    "SELECT j.*, f.job_id, f.model, f.training_file, f.validation_file, f.suffix, f.seed, f.method_json,"
    " f.metadata_json, f.created_at AS requested_at FROM fine_tuning_jobs f JOIN jobs j ON j.id = f.job_id"
)


@dataclass(frozen=True)
class FineTuningRecord:
    """One row of ``fine_tuning_jobs``."""

    job_id: str
    model: str
    training_file: str
    validation_file: str | None
    suffix: str | None
    seed: int
    method: dict[str, Any]
    metadata: dict[str, str] | None
    created_at: float

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> FineTuningRecord:
        return cls(
            job_id=row["job_id"],
            model=row["model"],
            training_file=row["training_file"],
            validation_file=row["validation_file"],
            suffix=row["suffix"],
            seed=row["seed"],
            method=json.loads(row["method_json"]),
            metadata=None if row["metadata_json"] is None else json.loads(row["metadata_json"]),
            created_at=row["requested_at"],
        )


class FineTuningStore:
    """``fine_tuning_jobs`` on the job store's database, and the newest-first pages OpenAI's API serves."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, record: FineTuningRecord) -> None:
        """Remember the request behind job ``record.job_id``."""
        self.db.conn.execute(
            "INSERT OR IGNORE INTO fine_tuning_jobs (job_id, model, training_file, validation_file, suffix, seed,"
            " method_json, metadata_json, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                record.job_id,
                record.model,
                record.training_file,
                record.validation_file,
                record.suffix,
                record.seed,
                json.dumps(record.method),
                None if record.metadata is None else json.dumps(record.metadata),
                record.created_at or time.time(),
            ),
        )

    def get(self, job_id: str) -> tuple[FineTuningRecord, JobRecord]:
        """The request and its job, or ``JobNotFound`` (also for a Ferry job not created through this API)."""
        row = self.db.conn.execute(_SELECT + " WHERE f.job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return FineTuningRecord.from_row(row), JobRecord.from_row(row)

    def page(self, *, after: str | None, limit: int) -> tuple[list[tuple[FineTuningRecord, JobRecord]], bool]:
        """Newest first; ``after`` is the last job id of the previous page. Returns ``(jobs, has_more)``."""
        sql, args = _SELECT, []
        if after is not None:  # a deleted job's place is kept (db.deleted_ids): the page starts at the next one
            seq = cursor_seq(self.db.conn, "jobs", after)
            if seq is None:
                raise JobNotFound(after)
            sql += " WHERE j.seq < ?"
            args.append(seq)
        rows = self.db.conn.execute(sql + " ORDER BY j.seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [(FineTuningRecord.from_row(r), JobRecord.from_row(r)) for r in rows[:limit]], len(rows) > limit

    def events_page(self, job_id: str, *, before: int | None, limit: int) -> tuple[list[EventRecord], bool]:
        """The job's events newest first (OpenAI's order), those with an id below ``before`` when given."""
        sql, args = "SELECT * FROM events WHERE job_id = ?", [job_id]
        if before is not None:
            sql += " AND id < ?"
            args.append(before)
        rows = self.db.conn.execute(sql + " ORDER BY id DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [EventRecord.from_row(r) for r in rows[:limit]], len(rows) > limit

    def step_losses(self, job_id: str, steps: list[int]) -> dict[int, float]:
        """The training loss stored for each of ``steps`` (absent: a step the retention dropped, or whose loss was
        not finite, a job that diverged)."""
        if not steps:
            return {}
        rows = self.db.conn.execute(
            "SELECT json_extract(data, '$.step') AS step, json_extract(data, '$.loss') AS loss FROM events"
            f" WHERE job_id = ? AND type = 'step' AND json_extract(data, '$.step') IN ({','.join('?' * len(steps))})",
            (job_id, *steps),
        ).fetchall()
        return {int(r["step"]): loss for r in rows if (loss := finite(r["loss"])) is not None}

    def step_rewards(self, job_id: str, steps: list[int]) -> dict[int, tuple[float | None, float | None]]:
        """A grpo job's reward mean and std stored for each of ``steps`` (absent: no grpo figures at that step)."""
        if not steps:
            return {}
        rows = self.db.conn.execute(
            "SELECT json_extract(data, '$.step') AS step, json_extract(data, '$.grpo.reward_mean') AS mean,"
            " json_extract(data, '$.grpo.reward_std') AS std FROM events WHERE job_id = ? AND type = 'step'"
            f" AND json_extract(data, '$.grpo') IS NOT NULL AND json_extract(data, '$.step') IN ({','.join('?' * len(steps))})",
            (job_id, *steps),
        ).fetchall()
        return {int(r["step"]): (finite(r["mean"]), finite(r["std"])) for r in rows}
