"""OpenAI's object shapes (``file``, ``fine_tuning.job``, ``fine_tuning.job.event``, ``fine_tuning.job.checkpoint``,
``list``), built from Ferry's records. Each carries OpenAI's fields; a few Ferry ones ride along (``sha256``,
``ferry``), which OpenAI's clients keep as extra attributes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from jobs.checkpoints.directory import CheckpointInfo
from service.queue.files import FileRecord
from service.queue.fine_tuning import FineTuningRecord
from service.queue.records import EventRecord, JobRecord
from service.queue.status import JobStatus
from service.queue.stored_json import NON_FINITE, finite
from service.uploads.recheck import is_current, rules_problem
from service.uploads.rows import RULES_VERSION

# Ferry's statuses as OpenAI names them. OpenAI has no pause: a paused job says so. An interrupted job is
# queued again at once (or fails when its retries are spent).
STATUS = {
    JobStatus.QUEUED: "queued",
    JobStatus.RUNNING: "running",
    JobStatus.PAUSED: "paused",
    JobStatus.SUCCEEDED: "succeeded",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "cancelled",
    JobStatus.INTERRUPTED: "queued",
}
_STATUS_MESSAGES = {
    "queued": "Job entered the queue ({reason})",
    "running": "Fine-tuning job started ({reason})",
    "paused": "Job paused ({reason})",
    "succeeded": "The job has successfully completed",
    "failed": "The job failed: {error}",
    "cancelled": "The job was cancelled",
    "interrupted": "The job's process stopped unexpectedly; it is queued again while retries remain",
}


class FilePublic(BaseModel):
    """An uploaded file (OpenAI's ``file``), with its SHA-256 and, for a fine-tuning file, its rows' layout.

    ``status``: ``processed`` once today's upload rules passed its rows (or for a file kept as sent), ``error``
    where they refuse a row (``status_details`` names it and the fix), ``uploaded`` for a file that only older
    rules checked and nothing has read since (a job naming it, or ``GET /v1/files/{id}``, checks it again).
    ``rules_version``: the version of the upload rules that last checked it (None: none did)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None
    sha256: str
    format: str | None = None  # chat | image_chat (chats with images) | preference | prompt (reinforcement rows)
    rows: int | None = None
    rules_version: int | None = None

    @classmethod
    def from_record(cls, record: FileRecord) -> FilePublic:
        status, details = _file_status(record)
        return cls(
            status=status,
            status_details=details,
            rules_version=record.rules_version,
            id=record.id,
            bytes=record.bytes,
            created_at=int(record.created_at),
            filename=record.filename,
            purpose=record.purpose,
            sha256=record.sha256,
            format=record.format,
            rows=record.rows,
        )


def _file_status(record: FileRecord) -> tuple[Literal["uploaded", "processed", "error"], str | None]:
    problem = rules_problem(record)
    if problem is not None:
        return "error", (
            f"fails the upload rules of version {record.rules_version}: {problem}; a job naming this file is "
            "refused. Fix that row and upload the file again (POST /v1/files)"
        )
    if not is_current(record):
        return "uploaded", (
            f"checked at upload by older upload rules than today's (version {RULES_VERSION}); checked again when a "
            "job names it or GET /v1/files/{id} reads it"
        )
    return "processed", None


class ListPage(BaseModel):
    """OpenAI's ``list``: a page of objects, newest first; ``after=<last_id>`` asks for the next."""

    object: Literal["list"] = "list"
    data: list[Any]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None

    @classmethod
    def of(cls, data: list[Any], has_more: bool) -> Any:
        return cls(
            data=data, has_more=has_more, first_id=data[0].id if data else None, last_id=data[-1].id if data else None
        )


class FilesPublic(ListPage):
    data: list[FilePublic]  # type: ignore[assignment]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class JobErrorPublic(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJobPublic(BaseModel):
    """OpenAI's ``fine_tuning.job`` for a Ferry job; ``ferry`` holds its Ferry status and where to read more."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None
    model: str
    fine_tuned_model: str | None
    organization_id: str = "ferry"
    status: str
    training_file: str
    validation_file: str | None
    hyperparameters: dict[str, Any]
    method: dict[str, Any]
    seed: int
    trained_tokens: int | None
    result_files: list[str] = []
    error: JobErrorPublic | None
    estimated_finish: int | None
    integrations: list[Any] = []
    metadata: dict[str, str] | None
    user_provided_suffix: str | None
    ferry: dict[str, Any]

    @classmethod
    def of(cls, request: FineTuningRecord, job: JobRecord) -> FineTuningJobPublic:
        step = job.progress or {}
        succeeded = job.status is JobStatus.SUCCEEDED
        eta = finite(step.get("eta_s")) if job.status is JobStatus.RUNNING else None
        tokens, elapsed = finite(step.get("tokens_per_s")), finite(step.get("elapsed_s"))
        return cls(
            id=job.id,
            created_at=int(job.created_at),
            finished_at=int(job.finished_at) if job.finished_at else None,
            model=request.model,
            fine_tuned_model=fine_tuned_model(request, job.id) if succeeded else None,
            status=STATUS[job.status],
            training_file=request.training_file,
            validation_file=request.validation_file,
            hyperparameters=request.method[request.method["type"]]["hyperparameters"],
            method=request.method,
            seed=request.seed,
            # An estimate: the last step's token rate over the job's training time (Ferry counts no total).
            trained_tokens=round(tokens * elapsed) if succeeded and tokens and elapsed else None,
            error=_error(job),
            estimated_finish=int(step["reported_at"] + eta) if eta is not None and step.get("reported_at") else None,
            metadata=request.metadata,
            user_provided_suffix=request.suffix,
            ferry={"status": job.status.value, "stop_requested": job.stop_request, "url": f"/v1/jobs/{job.id}"},
        )


def fine_tuned_model(request: FineTuningRecord, job_id: str, checkpoint_step: int | None = None) -> str:
    """OpenAI's name for the result, ``ft:<model>[:<suffix>]:<job id>`` (``:ckpt-step-<n>`` for a checkpoint);
    its weights are the job's checkpoints (``GET /v1/jobs/<id>/checkpoints``)."""
    name = ":".join(part for part in ("ft", request.model, request.suffix, job_id) if part)
    return name if checkpoint_step is None else f"{name}:ckpt-step-{checkpoint_step}"


def _error(job: JobRecord) -> JobErrorPublic | None:
    if job.status is not JobStatus.FAILED or not job.error_message:
        return None
    return JobErrorPublic(code=job.error_code or "training_error", message=job.error_message)


class EventPublic(BaseModel):
    """OpenAI's ``fine_tuning.job.event`` for a Ferry event: ``metrics`` for a step, a ``message`` otherwise."""

    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"]
    data: dict[str, Any]

    @classmethod
    def of(cls, event: EventRecord) -> EventPublic:
        data, level, kind = event.data, "info", "message"
        if event.type in ("step", "eval"):
            data = _figures(data)  # a diverged job's NaN loss is stored as "NaN": it answers null
        if event.type == "step":
            kind = "metrics"
            message = f"Step {data['step']}/{data['total_steps']}: training loss={_loss(data['loss'])}"
            data = {**data, "train_loss": data["loss"]}  # OpenAI's metrics name, beside Ferry's step figures
            grpo = data.get("grpo")
            if isinstance(grpo, dict):  # a reinforcement job: the step's rewards, as the message's headline
                mean, std = grpo.get("reward_mean"), grpo.get("reward_std")
                message += f", reward mean={_figure(mean)} std={_figure(std)}"
                data = {**data, "train_reward_mean": mean, "train_reward_std": std}
        elif event.type == "status":
            status = data["status"]
            error = (data.get("error") or {}).get("message", "")
            message = _STATUS_MESSAGES.get(status, "Job status: {reason}").format(
                reason=data.get("reason"), error=error
            )
            level = "error" if status == "failed" else "info"
        elif event.type == "checkpoint":
            message = f"Checkpoint created at step {data['step']}"
        elif event.type == "eval":
            message = f"Step {data['step']}: validation loss={_loss(data.get('eval_loss'))}"
        elif event.type == "finished":
            message = f"Training ended ({data['status']}) at step {data['step']}"
        elif event.type == "failed":
            message, level = f"Training failed: {data.get('message')}", "error"
        elif event.type == "log":
            message = data.get("message", "")
            level = {"warning": "warn", "error": "error"}.get(data.get("level", "info"), "info")
        else:
            message = event.type.replace("_", " ").capitalize()
        return cls(
            id=f"ftevent-{event.id}",
            created_at=int(event.created_at),
            level=level,
            message=message,
            type=kind,
            data=data,
        )


class CheckpointPublic(BaseModel):
    """OpenAI's ``fine_tuning.job.checkpoint``; ``ferry.files`` lists its files for download."""

    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, float | None]
    step_number: int
    ferry: dict[str, Any]

    @classmethod
    def of(
        cls,
        request: FineTuningRecord,
        info: CheckpointInfo,
        train_loss: float | None,
        created_at: float,
        rewards: tuple[float | None, float | None] | None = None,
    ) -> CheckpointPublic:
        """``rewards``: a reinforcement job's reward mean and std at the checkpoint's step."""
        job_id = request.job_id
        metrics = {"step": float(info.step), "train_loss": train_loss, "valid_loss": info.eval_loss}
        if rewards is not None:
            metrics.update(train_reward_mean=rewards[0], train_reward_std=rewards[1])
        return cls(
            id=checkpoint_id(job_id, info.step),
            created_at=int(created_at),
            fine_tuned_model_checkpoint=fine_tuned_model(request, job_id, info.step),
            fine_tuning_job_id=job_id,
            metrics=metrics,
            step_number=info.step,
            ferry={"name": info.name, "url": f"/v1/jobs/{job_id}/checkpoints/{info.name}/files"},
        )


def _loss(value: Any) -> str:
    loss = finite(value)
    return f"{loss:.4f}" if loss is not None else "not finite (the job has diverged: lower the learning rate)"


def _figure(value: Any) -> str:
    number = finite(value)
    return f"{number:.4f}" if number is not None else "n/a"


def _figures(data: Any) -> Any:
    """A step's or evaluation's stored figures with each non-finite one (stored as "NaN", ...) as None."""
    if isinstance(data, dict):
        return {key: _figures(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_figures(value) for value in data]
    return None if isinstance(data, str) and data in NON_FINITE else data


def checkpoint_id(job_id: str, step: int) -> str:
    return f"ftckpt-{job_id.removeprefix('job-')}-{step}"
