"""Shapes of the REST API, separate from the stored records (``records.py``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from .records import EventRecord, JobRecord
from .status import JobStatus


def _time(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


class Problem(BaseModel):
    path: str
    message: str
    line: int | None = None
    suggestion: str | None = None


class ErrorDetail(BaseModel):
    code: str
    message: str
    problems: list[Problem] | None = None


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: ``{"error": {"code", "message", "problems"?}}``."""

    error: ErrorDetail


class Progress(BaseModel):
    step: int
    total_steps: int | None
    percent: float | None
    elapsed_s: float | None
    eta_s: float | None
    estimated_finish: datetime | None


class JobError(BaseModel):
    code: str | None
    message: str | None


class JobPublic(BaseModel):
    """A job as the API shows it: status, progress, the latest metrics and memory figures, the spec."""

    id: str
    name: str | None
    status: JobStatus
    stop_requested: str | None  # 'pause' or 'cancel' while a running job winds down
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int
    retries: int
    worker: str | None
    device: str | None
    progress: Progress | None
    metrics: dict[str, Any] | None  # the latest step: loss, lr, throughput
    memory: dict[str, Any] | None  # device allocated/reserved/peak, host RSS, pinned bytes
    offload: dict[str, Any] | None  # the offload engine's figures for the latest step
    last_checkpoint: dict[str, Any] | None
    error: JobError | None
    spec: dict[str, Any]
    spec_text: str

    @classmethod
    def from_record(cls, job: JobRecord) -> JobPublic:
        step = job.progress or {}
        return cls(
            id=job.id,
            name=job.name,
            status=job.status,
            stop_requested=job.stop_request,
            created_at=_time(job.created_at),
            updated_at=_time(job.updated_at),
            started_at=_time(job.started_at),
            finished_at=_time(job.finished_at),
            attempt=job.attempt,
            retries=job.retries,
            worker=job.worker,
            device=job.device,
            progress=_progress(job),
            metrics=_pick(step, _METRIC_KEYS),
            memory=_pick(step, _MEMORY_KEYS),
            offload=step.get("offload"),
            last_checkpoint=_checkpoint_summary(job.checkpoint),
            error=JobError(code=job.error_code, message=job.error_message) if job.error_message else None,
            spec=job.spec,
            spec_text=job.spec_text,
        )


_METRIC_KEYS = ("loss", "lr", "samples_per_s", "tokens_per_s")
_MEMORY_KEYS = (
    "device_allocated_bytes",
    "device_reserved_bytes",
    "device_peak_bytes",
    "host_rss_bytes",
    "pinned_bytes",
)


def _pick(step: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any] | None:
    picked = {k: step[k] for k in keys if k in step}
    return picked or None


def _progress(job: JobRecord) -> Progress | None:
    step = job.progress or {}
    total = job.total_steps or step.get("total_steps")
    if not step and total is None:
        return None
    current = int(step.get("step", 0))
    eta = step.get("eta_s") if job.status is JobStatus.RUNNING else None
    reported_at = step.get("reported_at")
    return Progress(
        step=current,
        total_steps=total,
        percent=round(100.0 * current / total, 2) if total else None,
        elapsed_s=step.get("elapsed_s"),
        eta_s=eta,
        estimated_finish=_time(reported_at + eta) if eta is not None and reported_at else None,
    )


def _checkpoint_summary(event: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if event is None else {"name": event.get("name"), "step": event.get("step")}


class JobsPublic(BaseModel):
    data: list[JobPublic]
    next_cursor: str | None  # pass as ?cursor= for the next (older) page; None on the last page


class EventPublic(BaseModel):
    id: int
    job_id: str
    attempt: int
    type: str
    created_at: datetime
    data: dict[str, Any]

    @classmethod
    def from_record(cls, event: EventRecord) -> EventPublic:
        return cls(
            id=event.id,
            job_id=event.job_id,
            attempt=event.attempt,
            type=event.type,
            created_at=_time(event.created_at),
            data=event.data,
        )


class EventsPublic(BaseModel):
    data: list[EventPublic]
    next_cursor: int  # pass as ?after= to get what comes next
    has_more: bool  # more events exist now beyond this page


class MetricsPublic(BaseModel):
    """The per-step series: one point per ``step`` event."""

    data: list[dict[str, Any]]
    next_cursor: int
    has_more: bool


class CheckpointFile(BaseModel):
    name: str
    bytes: int
    sha256: str
    url: str


class CheckpointPublic(BaseModel):
    name: str
    step: int
    created: datetime | float | str | None
    files: list[CheckpointFile]


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]


class DeviceFit(BaseModel):
    worker: str
    device: str | None
    memory_total_bytes: int | None
    memory_limit_bytes: int | None = None  # offload.gpu_memory_limit: the job may use no more of the GPU
    fits: bool | None


class FitEstimate(BaseModel):
    peak_device_bytes: int
    pinned_host_bytes: int
    notes: list[str]
    host_available_bytes: int
    host_total_bytes: int = 0
    fits: bool | None  # None when the service cannot tell (GPU sizes unknown)
    devices: list[DeviceFit]


class ValidationPublic(BaseModel):
    valid: bool
    name: str | None
    spec: dict[str, Any]
    estimate: FitEstimate | None
    estimate_error: str | None = None  # why there is no estimate


class WorkerPublic(BaseModel):
    id: str
    device: str | None
    gpu_name: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    job_id: str | None
    pid: int | None


class WorkersPublic(BaseModel):
    data: list[WorkerPublic]
