"""Shapes of the REST API, separate from the stored records (``records.py``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field

from jobs import OffloadStats
from jobs.events import ErrorCode, EvalEvent, MemorySnapshot, SampleEvent, StepEvent, StepMetrics
from service.checking.fit_shapes import FitEstimate
from service.queue.events import JobError, StoredEvent, upgrade_stored_event
from service.queue.records import EventRecord, JobRecord
from service.queue.status import JobAction, JobStatus, allowed_actions


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


class CheckpointSummary(BaseModel):
    """The job's newest checkpoint (``GET /v1/jobs/{id}/checkpoints`` lists them with their files)."""

    name: str
    step: int


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
    metrics: StepMetrics | None = Field(description="the latest step: loss, lr, throughput")
    memory: MemorySnapshot | None = Field(description="after the latest step: device, host RSS, pinned bytes")
    offload: OffloadStats | None = Field(description="the offload engine's counters after the latest step")
    last_checkpoint: CheckpointSummary | None
    error: JobError | None
    allowed_actions: list[JobAction] = Field(description="what the service accepts for this job now")
    spec: dict[str, Any] | None = Field(None, description="the resolved spec; in a listing only with include_spec")
    spec_text: str | None = Field(None, description="the spec as submitted; in a listing only with include_spec")

    @classmethod
    def from_record(cls, job: JobRecord, *, include_spec: bool = True) -> JobPublic:
        # One validation of plain data, in pydantic's core, rather than a model built per section in
        # Python and each validated again inside this one: the hot polls build this (bench/profile_requests.py).
        step = job.progress or {}
        checkpoint = job.checkpoint
        return cls.model_validate(
            {
                "id": job.id,
                "name": job.name,
                "status": job.status,
                "stop_requested": job.stop_request,
                "created_at": _time(job.created_at),
                "updated_at": _time(job.updated_at),
                "started_at": _time(job.started_at),
                "finished_at": _time(job.finished_at),
                "attempt": job.attempt,
                "retries": job.retries,
                "worker": job.worker,
                "device": job.device,
                "progress": _progress(job),
                "metrics": _section(StepMetrics, step),
                "memory": _section(MemorySnapshot, step),
                "offload": step.get("offload") or None,
                "last_checkpoint": {"name": checkpoint["name"], "step": checkpoint["step"]} if checkpoint else None,
                "error": _error(job),
                "allowed_actions": allowed_actions(job.status, job.stop_request),
                "spec": job.spec if include_spec else None,
                "spec_text": job.spec_text if include_spec else None,
            }
        )


_REQUIRED = {
    model: tuple(name for name, field in model.model_fields.items() if field.is_required())
    for model in (StepMetrics, MemorySnapshot)
}


def _section(model: type[StepMetrics] | type[MemorySnapshot], step: dict[str, Any]) -> dict[str, Any] | None:
    """The part of the latest step event that ``model`` declares (None before the first step, and for a
    cache job's progress, which has no loss or learning rate)."""
    if not step or any(step.get(name) is None for name in _REQUIRED[model]):
        return None
    return {k: step[k] for k in model.model_fields if k in step}


def _error(job: JobRecord) -> JobError | None:
    if not job.error_message:
        return None
    return JobError(code=ErrorCode.from_stored(job.error_code or ""), message=job.error_message)


def _progress(job: JobRecord) -> dict[str, Any] | None:
    step = job.progress or {}
    total = job.total_steps or step.get("total_steps")
    if not step and total is None:
        return None
    current = int(step.get("step", 0))
    eta = step.get("eta_s") if job.status is JobStatus.RUNNING else None
    reported_at = step.get("reported_at")
    return {
        "step": current,
        "total_steps": total,
        "percent": round(100.0 * current / total, 2) if total else None,
        "elapsed_s": step.get("elapsed_s"),
        "eta_s": eta,
        "estimated_finish": _time(reported_at + eta) if eta is not None and reported_at else None,
    }


class JobsPublic(BaseModel):
    data: list[JobPublic]
    next_cursor: str | None  # pass as ?cursor= for the next (older) page; None on the last page


class EventPublic(BaseModel):
    id: int
    job_id: str
    attempt: int
    type: str
    created_at: datetime
    data: StoredEvent

    @classmethod
    def from_record(cls, event: EventRecord) -> EventPublic:
        # One validation, the event's data included (a stream replaying a long job renders many of these).
        return cls.model_validate(
            {
                "id": event.id,
                "job_id": event.job_id,
                "attempt": event.attempt,
                "type": event.type,
                "created_at": _time(event.created_at),
                "data": upgrade_stored_event(event.data),
            }
        )


class EventsPublic(BaseModel):
    data: list[EventPublic]
    next_cursor: int  # pass as ?after= to get what comes next
    has_more: bool  # more events exist now beyond this page


class MetricPoint(StepEvent):
    """One ``step`` event of the series, with its event id and the time it was stored (seconds since 1970)."""

    event_id: int
    time: float


class EvalPoint(EvalEvent):
    """One ``eval`` event at a step, with its event id and time stored: the eval loss, and its perplexity (SFT) or the
    preference reward figures (dpo, orpo)."""

    event_id: int
    time: float


class MetricsPublic(BaseModel):
    """The per-step series (one point per ``step`` event) and the evaluations in the same cursor range."""

    data: list[MetricPoint]
    eval: list[EvalPoint] = []
    next_cursor: int
    has_more: bool


class SamplePoint(SampleEvent):
    """One ``sample`` event: what the model generated for a prompt at a step (text, or an image at ``url``)."""

    event_id: int
    time: float
    url: str | None = Field(None, description="the artifact (an image) for GET, with the API token; null for text")


class SamplesPublic(BaseModel):
    data: list[SamplePoint]
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
    eval_loss: float | None = None  # measured at this step, when the job evaluates
    best: bool = False  # the lowest eval loss of the job's checkpoints
    damaged: str | None = None  # why its manifest cannot be used; a damaged checkpoint lists no files
    # Made from it (the spec's export: section, POST .../merge or .../gguf): a merged .tar, GGUF files and
    # their Modelfiles, each with its download url.
    exports: list[CheckpointFile] = []
    mergeable: bool = Field(
        False, description="a LoRA adapter of a family that merges: POST .../merge makes a full model of it"
    )


class MergedPublic(BaseModel):
    """A LoRA checkpoint merged into its base model, packed as one archive."""

    checkpoint: str
    archive: CheckpointFile


class GgufPublic(BaseModel):
    """A checkpoint written as one GGUF file (LoRA merged first), with an Ollama Modelfile beside it."""

    checkpoint: str
    quant: str
    gguf: CheckpointFile
    modelfile: CheckpointFile


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]


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
