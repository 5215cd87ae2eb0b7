"""/v1/fine_tuning/jobs: OpenAI's fine-tuning API over Ferry's queue (create, list, retrieve, cancel, pause, resume,
events, checkpoints), in OpenAI's object shapes and error envelope.

A created job is an ordinary Ferry job (``/v1/jobs/<id>`` shows it too): the request becomes a spec
(``openai/create.py``), checked as any submission is, and queued. ``fine_tuning_jobs`` remembers the request.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Header, Query

from jobs.checkpoints.directory import list_checkpoints
from service.api.deps import (
    FilesDep,
    FineTuningDep,
    GpuMonitorDep,
    SchedulerDep,
    SettingsDep,
    SpecBody,
    SpecCheckerDep,
    StoreDep,
)
from service.api.errors import ApiError
from service.api.openai.base_model import is_image_text_model
from service.api.openai.create import build_spec, new_seed, parse_create, request_error, resolved_method
from service.api.openai.errors import OpenAIErrorBody, OpenAIRoute
from service.api.openai.problems import in_request_terms
from service.api.openai.shapes import CheckpointPublic, EventPublic, FineTuningJobPublic, ListPage, checkpoint_id
from service.api.submission import queue_checked_spec
from service.checking.messages import CheckRequest
from service.queue.db import retry_locked
from service.queue.disk import refuse_if_disk_low
from service.queue.files import FileNotFound, FileStore
from service.queue.fine_tuning import FineTuningRecord
from service.queue.store import IdempotencyConflict
from service.settings import Settings
from service.uploads.recheck import CHECKED_PURPOSE, FileFailsRules, require_current_rules
from service.uploads.rows import first_image_row

router = APIRouter(prefix="/fine_tuning/jobs", tags=["fine-tuning (OpenAI-compatible)"], route_class=OpenAIRoute)
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": OpenAIErrorBody},
    404: {"model": OpenAIErrorBody},
    409: {"model": OpenAIErrorBody},
}
_CREATE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}}


@router.post("", openapi_extra=_CREATE_BODY, responses={**_ERRORS, 429: {"model": OpenAIErrorBody}})
def create_fine_tuning_job(
    body: SpecBody,
    store: StoreDep,
    files: FilesDep,
    fine_tuning: FineTuningDep,
    scheduler: SchedulerDep,
    settings: SettingsDep,
    gpus: GpuMonitorDep,
    checker: SpecCheckerDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> FineTuningJobPublic:
    """Create a fine-tuning job from uploaded files; it is checked as ``POST /v1/jobs`` checks a spec, then queued."""
    create = parse_create(body)
    training = _uploaded(files, create.training_file, "training_file", settings)
    uploads = [("training_file", training)]
    if create.validation_file:
        uploads.append(("validation_file", _uploaded(files, create.validation_file, "validation_file", settings)))
    image_text = is_image_text_model(create.model, settings.effective_model_roots)
    if not image_text:
        for param, record in uploads:
            _refuse_images_for_a_text_model(create.model, param, record, settings)
    seed = create.seed if create.seed is not None else new_seed()
    spec = build_spec(create, training_format=training.format, seed=seed, image_text=image_text)
    text = yaml.safe_dump(spec, sort_keys=False)
    try:
        checked = checker.check(
            CheckRequest.for_service(text, settings, scheduler.slots, gpus.gpus(), queue_anyway=False, fit="refuse")
        )
        job, created = queue_checked_spec(
            checked, text, body, store=store, files=files, settings=settings, idempotency_key=idempotency_key
        )
    except IdempotencyConflict:
        raise request_error(
            None, f"Idempotency-Key {idempotency_key!r} was already used with another request."
        ) from None
    except ApiError as error:  # the spec is Ferry's, not the user's: say it in the request's fields
        raise in_request_terms(error, create, uploads_dir=settings.uploads_dir) from None
    if created:
        record = FineTuningRecord(
            job_id=job.id,
            model=create.model,
            training_file=create.training_file,
            validation_file=create.validation_file,
            suffix=create.suffix,
            seed=seed,
            method=resolved_method(create, checked.spec),
            metadata=create.metadata,
            created_at=job.created_at,
        )
        retry_locked(lambda: fine_tuning.add(record))  # the job is queued: its request must not be lost to a lock
        scheduler.wake()
    return FineTuningJobPublic.of(*fine_tuning.get(job.id))


@router.get("", responses=_ERRORS)
def list_fine_tuning_jobs(
    fine_tuning: FineTuningDep,
    after: Annotated[str | None, Query(max_length=64, description="the last job id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage:
    """Jobs created through this API, newest first."""
    jobs, has_more = fine_tuning.page(after=after, limit=limit)
    return ListPage.of([FineTuningJobPublic.of(request, job) for request, job in jobs], has_more)


@router.get("/{job_id}", responses=_ERRORS)
def retrieve_fine_tuning_job(job_id: str, fine_tuning: FineTuningDep) -> FineTuningJobPublic:
    """One job, OpenAI's shape (``GET /v1/jobs/<id>`` has Ferry's, with progress and memory)."""
    return FineTuningJobPublic.of(*fine_tuning.get(job_id))


@router.post("/{job_id}/cancel", responses=_ERRORS)
def cancel_fine_tuning_job(
    job_id: str, store: StoreDep, fine_tuning: FineTuningDep, scheduler: SchedulerDep
) -> FineTuningJobPublic:
    """Cancel; a running job stops within FERRY_CANCEL_GRACE_S (``ferry.stop_requested``: cancel meanwhile)."""
    fine_tuning.get(job_id)
    store.cancel(job_id)
    scheduler.wake()
    return FineTuningJobPublic.of(*fine_tuning.get(job_id))


@router.post("/{job_id}/pause", responses=_ERRORS)
def pause_fine_tuning_job(
    job_id: str, store: StoreDep, fine_tuning: FineTuningDep, scheduler: SchedulerDep
) -> FineTuningJobPublic:
    """Pause: a running job checkpoints at its next step and frees its worker (status ``paused``)."""
    fine_tuning.get(job_id)
    store.pause(job_id)
    scheduler.wake()
    return FineTuningJobPublic.of(*fine_tuning.get(job_id))


@router.post("/{job_id}/resume", responses=_ERRORS)
def resume_fine_tuning_job(
    job_id: str, store: StoreDep, fine_tuning: FineTuningDep, scheduler: SchedulerDep, settings: SettingsDep
) -> FineTuningJobPublic:
    """Queue a paused (or failed) job again; it continues from its last checkpoint."""
    fine_tuning.get(job_id)
    refuse_if_disk_low(settings.data_dir, settings.min_free_disk_bytes)
    store.resume(job_id)
    scheduler.wake()
    return FineTuningJobPublic.of(*fine_tuning.get(job_id))


@router.get("/{job_id}/events", responses=_ERRORS)
def list_fine_tuning_events(
    job_id: str,
    fine_tuning: FineTuningDep,
    after: Annotated[
        str | None, Query(pattern=r"^(ftevent-)?[0-9]{1,18}$", description="the last event id seen")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> ListPage:
    """The job's events newest first, as OpenAI lists them; ``after`` pages back to older ones. Steps are
    ``metrics`` events (``data.train_loss``), status changes, checkpoints and errors ``message`` events."""
    fine_tuning.get(job_id)
    before = int(after.removeprefix("ftevent-")) if after else None
    events, has_more = fine_tuning.events_page(job_id, before=before, limit=limit)
    return ListPage.of([EventPublic.of(e) for e in events], has_more)


@router.get("/{job_id}/checkpoints", responses=_ERRORS)
def list_fine_tuning_checkpoints(
    job_id: str,
    fine_tuning: FineTuningDep,
    settings: SettingsDep,
    after: Annotated[
        str | None, Query(max_length=100, description="the last checkpoint id of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> ListPage:
    """The job's complete checkpoints, newest first; ``ferry.url`` lists each one's files for download."""
    request, _ = fine_tuning.get(job_id)
    output = settings.job_dir(job_id) / "output"
    found = list(reversed(list_checkpoints(output))) if output.exists() else []
    if after is not None:  # by step, so a checkpoint removed since (a cleanup, a disk full) still pages on
        last = _checkpoint_step(job_id, after)
        found = [info for info in found if info.step < last]
    page, has_more = found[:limit], len(found) > limit
    steps = [info.step for info in page]
    losses, rewards = fine_tuning.step_losses(job_id, steps), fine_tuning.step_rewards(job_id, steps)
    data = [
        CheckpointPublic.of(
            request,
            info,
            losses.get(info.step),
            datetime.fromisoformat(info.created).timestamp(),
            rewards.get(info.step),
        )
        for info in page
    ]
    return ListPage.of(data, has_more)


def _checkpoint_step(job_id: str, after: str) -> int:
    """The step of checkpoint id ``after`` (``ftckpt-<job>-<step>``), or a 400 naming ``after``."""
    prefix = checkpoint_id(job_id, 0).removesuffix("0")
    step = after.removeprefix(prefix)
    if not after.startswith(prefix) or not step.isdigit() or len(step) > 18:
        raise request_error("after", f"after: {after!r} is no checkpoint id of {job_id} (they read {prefix}<step>).")
    return int(step)


def _refuse_images_for_a_text_model(model: str, param: str, record: Any, settings: Settings) -> None:
    """A 400 naming the first row with an image, when a text-only base model would be given an image file."""
    if record.format != "image_chat":
        return
    found = first_image_row(settings.uploads_dir / record.path, max_line_bytes=settings.max_upload_line_bytes)
    row, field = found if found is not None else (1, "messages")
    raise request_error(
        param,
        f"{param}: {record.id} row {row}: field '{field}' is an image, and model {model!r} is a text-only model "
        "(its config.json has no vision_config); fine-tune a vision-language model (one AutoModelForImageTextToText "
        "loads, with its processor, e.g. Qwen2.5-VL or SmolVLM) on this file, or upload it without image parts.",
    )


def _uploaded(files: FileStore, file_id: str, param: str, settings: Settings) -> Any:
    """The fine-tuning upload ``file_id``, its rows passed by today's upload rules (checked again first where
    older rules checked them: the layout they give builds the spec); a 400 naming ``param`` otherwise."""
    missing = request_error(param, f"{param}: no uploaded file {file_id!r}; upload it with POST /v1/files first.")
    try:
        record = files.get(file_id)
    except FileNotFound:
        raise missing from None
    if record.purpose != CHECKED_PURPOSE:
        raise request_error(
            param,
            f"{param}: file {file_id} was uploaded with purpose {record.purpose!r}; upload it with purpose 'fine-tune'.",
        )
    try:
        return require_current_rules(
            files, record, uploads_dir=settings.uploads_dir, max_line_bytes=settings.max_upload_line_bytes
        )
    except FileNotFound:  # deleted while it was read
        raise missing from None
    except FileFailsRules as fails:
        raise request_error(param, f"{param}: {fails}") from None
