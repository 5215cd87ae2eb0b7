"""Queueing a spec the checker has accepted: the one path from a checked spec to a stored job, shared by
``POST /v1/jobs`` and the OpenAI-compatible ``POST /v1/fine_tuning/jobs``."""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
from typing import Any

from service.api.errors import ApiError, database_busy
from service.checking.messages import CheckedSpec
from service.queue.db import is_locked, retry_locked
from service.queue.disk import refuse_if_disk_low
from service.queue.files import FileStore
from service.queue.records import JobRecord
from service.queue.store import JobStore, QueueFull, UploadsGone
from service.settings import Settings
from service.uploads.named import uploads_named
from service.uploads.recheck import stale_uploads

RETRY_AFTER_S = 10  # a full queue: about when a job may have started and freed a place


def queue_checked_spec(
    checked: CheckedSpec,
    text: str,
    body: bytes,
    *,
    store: JobStore,
    files: FileStore,
    settings: Settings,
    idempotency_key: str | None,
) -> tuple[JobRecord, bool]:
    """Store the job of ``checked`` (the spec's ``text``, the request's ``body`` for its idempotency digest).

    Returns:
        The job and whether this call created it (``False``: the same request again under its idempotency key).

    Raises:
        ApiError: 507 when the data directory's disk is low, the checker's refusal (no GPU worker, does not
            fit), 422 when an upload it names fails today's upload rules (``refuse_stale_uploads``), 429 when the
            queue is full, 409 when an upload the spec names was deleted meanwhile, or 503
            (Retry-After) when another connection holds the database's lock through every retry.
        IdempotencyConflict: the key was used with another request; each API answers it in its own words.
    """
    refuse_if_disk_low(settings.data_dir, settings.min_free_disk_bytes)
    if checked.refusal is not None:  # no GPU worker for device: cuda, or estimated not to fit
        raise checked.refusal.error()
    refuse_stale_uploads(checked.spec, files, settings)
    job_id = f"job-{secrets.token_hex(6)}"  # one id for every try: a try that did commit is found by its key
    try:
        return retry_locked(
            lambda: store.create_job(
                job_id=job_id,
                name=checked.name,
                spec_text=text,
                spec=checked.spec,
                idempotency_key=idempotency_key,
                request_sha256=hashlib.sha256(body).hexdigest(),
                max_queued=settings.max_queued_jobs,
                uploads=uploads_named(checked.spec, settings.uploads_dir),
            )
        )
    except sqlite3.OperationalError as error:
        if is_locked(error):
            raise database_busy() from None
        raise
    except UploadsGone as gone:
        raise ApiError(409, "file_deleted", str(gone)) from None
    except QueueFull:
        raise ApiError(
            429,
            "queue_full",
            f"The queue already holds {settings.max_queued_jobs} jobs "
            "(FERRY_MAX_QUEUED_JOBS); wait for some to start or cancel queued ones.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None


def refuse_stale_uploads(spec: dict[str, Any], files: FileStore, settings: Settings) -> None:
    """Check again, by today's upload rules, each fine-tuning upload the resolved spec names that older rules
    checked (uploads/recheck.py); a 422 naming the spec's field, the file, its row and field where one fails.

    An upload deleted meanwhile is left to ``JobStore.create_job`` (409 ``file_deleted``)."""
    problems = [
        {"path": spec_path, "message": str(fails), "line": None, "suggestion": None}
        for spec_path, fails in stale_uploads(
            spec, files, uploads_dir=settings.uploads_dir, max_line_bytes=settings.max_upload_line_bytes
        )
    ]
    if problems:
        said = "; ".join(f"{p['path']}: {p['message']}" for p in problems)
        raise ApiError(422, "invalid_file", said, problems=problems)
