"""What the store keeps: plain records, separate from the API shapes in ``schemas.py``."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from service.queue.status import JobStatus


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


@dataclass(frozen=True)
class JobRecord:
    """One row of ``jobs``."""

    seq: int
    id: str
    name: str | None
    status: JobStatus
    spec_text: str
    spec_json: str
    total_steps: int | None
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    attempt: int
    retries: int
    worker: str | None
    device: str | None
    pid: int | None
    pid_started_at: float | None
    stop_request: str | None
    error_code: str | None
    error_message: str | None
    progress: dict[str, Any] | None
    checkpoint: dict[str, Any] | None
    idempotency_key: str | None
    request_sha256: str | None

    @cached_property
    def spec(self) -> dict[str, Any]:
        """The resolved spec; decoded only when asked for (a listing leaves it out)."""
        return json.loads(self.spec_json)

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> JobRecord:
        return cls(
            seq=row["seq"],
            id=row["id"],
            name=row["name"],
            status=JobStatus(row["status"]),
            spec_text=row["spec_text"],
            spec_json=row["spec_json"],
            total_steps=row["total_steps"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            attempt=row["attempt"],
            retries=row["retries"],
            worker=row["worker"],
            device=row["device"],
            pid=row["pid"],
            pid_started_at=row["pid_started_at"],
            stop_request=row["stop_request"],
            error_code=row["error_code"],
            error_message=row["error_message"],
            progress=_json(row["progress_json"]),
            checkpoint=_json(row["checkpoint_json"]),
            idempotency_key=row["idempotency_key"],
            request_sha256=row["request_sha256"],
        )


@dataclass(frozen=True)
class EventRecord:
    """One row of ``events``: a progress event from the job, or a ``status`` event from the store."""

    id: int
    job_id: str
    attempt: int
    type: str
    created_at: float
    data: dict[str, Any]

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> EventRecord:
        return cls(
            id=row["id"],
            job_id=row["job_id"],
            attempt=row["attempt"],
            type=row["type"],
            created_at=row["created_at"],
            data=json.loads(row["data"]),
        )
