"""/v1/jobs: submit, validate, list, read, cancel, pause, resume, delete."""

from __future__ import annotations

import logging
import shutil
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response, status

from service.api.deps import (
    FilesDep,
    GpuMonitorDep,
    SchedulerDep,
    SettingsDep,
    SpecBody,
    SpecCheckerDep,
    StoreDep,
    answers_of,
    store_of,
)
from service.api.errors import INT64_MAX, ApiError
from service.api.intake import spec_text_from_body
from service.api.schemas import ErrorBody, JobPublic, JobsPublic, ValidationPublic
from service.api.submission import queue_checked_spec, refuse_stale_uploads
from service.checking.messages import CheckRequest
from service.queue.disk import refuse_if_disk_low, with_space_to_free
from service.queue.status import JobStatus
from service.queue.store import IdempotencyConflict

log = logging.getLogger("ferry.api")
router = APIRouter(prefix="/jobs", tags=["jobs"])

_SPEC_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/yaml": {"schema": {"type": "string"}},
            "application/json": {"schema": {"type": "object"}},
        },
    }
}
_ERRORS = {401: {"model": ErrorBody}, 404: {"model": ErrorBody}, 409: {"model": ErrorBody}}


@router.post(
    "",
    status_code=201,
    openapi_extra=_SPEC_BODY,
    responses={
        200: {"model": JobPublic, "description": "a repeated Idempotency-Key"},
        413: {"model": ErrorBody},
        422: {"model": ErrorBody},
        429: {"model": ErrorBody},
        507: {"model": ErrorBody, "description": "the data directory's disk is short of space"},
    },
)
def create_job(
    body: SpecBody,
    request: Request,
    response: Response,
    store: StoreDep,
    files: FilesDep,
    scheduler: SchedulerDep,
    settings: SettingsDep,
    gpus: GpuMonitorDep,
    checker: SpecCheckerDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    fit_check: Annotated[bool, Query(description="false: queue even a job estimated not to fit any GPU")] = True,
    queue_anyway: Annotated[
        bool, Query(description="true: queue even a device: cuda job without a GPU worker")
    ] = False,
) -> JobPublic:
    """Queue a job from a YAML (or JSON) spec. Every problem in the spec is reported at once, and a GPU job
    estimated to exceed every GPU's memory is refused (422 ``does_not_fit``) unless ``fit_check=false``."""
    text = spec_text_from_body(
        body,
        request.headers.get("content-type"),
        max_depth=settings.max_yaml_depth,
        max_nodes=settings.max_yaml_nodes,
    )
    fit = "refuse" if fit_check else "skip"
    check = CheckRequest.for_service(text, settings, scheduler.slots, gpus.gpus(), queue_anyway=queue_anyway, fit=fit)
    checked = checker.check(check)  # the spec's problems: 422, all at once (in the checker's process)
    try:
        job, created = queue_checked_spec(
            checked, text, body, store=store, files=files, settings=settings, idempotency_key=idempotency_key
        )
    except IdempotencyConflict:
        raise ApiError(
            422,
            "idempotency_key_reused",
            f"Idempotency-Key {idempotency_key!r} was already used "
            "with a different spec; send a new key for a new job.",
        ) from None
    if created:
        scheduler.wake()
        response.headers["Location"] = f"/v1/jobs/{job.id}"
    else:
        response.status_code = status.HTTP_200_OK
    return JobPublic.from_record(job)


@router.post("/validate", openapi_extra=_SPEC_BODY, responses={422: {"model": ErrorBody}})
def validate_job(
    body: SpecBody,
    request: Request,
    settings: SettingsDep,
    files: FilesDep,
    scheduler: SchedulerDep,
    gpus: GpuMonitorDep,
    checker: SpecCheckerDep,
    queue_anyway: Annotated[bool, Query(description="true: accept a device: cuda job without a GPU worker")] = False,
) -> ValidationPublic:
    """The same checks as submitting, plus whether the job fits this service's GPUs; queues nothing."""
    text = spec_text_from_body(
        body,
        request.headers.get("content-type"),
        max_depth=settings.max_yaml_depth,
        max_nodes=settings.max_yaml_nodes,
    )
    check = CheckRequest.for_service(
        text, settings, scheduler.slots, gpus.gpus(), queue_anyway=queue_anyway, fit="report"
    )
    checked = checker.check(check)
    if checked.refusal is not None:
        raise checked.refusal.error()
    refuse_stale_uploads(checked.spec, files, settings)
    return ValidationPublic(
        valid=True,
        name=checked.name,
        spec=checked.spec,
        estimate=checked.estimate,
        estimate_error=checked.estimate_error,
    )


@router.get("", response_model=JobsPublic)
async def list_jobs(
    request: Request,
    status: Annotated[list[JobStatus] | None, Query(description="repeat to match several")] = None,
    cursor: Annotated[
        str | None, Query(pattern=r"^[0-9]{1,19}$", description="next_cursor of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    include_spec: Annotated[bool, Query(description="true: each job's spec and spec_text too")] = False,
) -> Response:
    """Jobs, newest first, one page at a time (read in the event loop, as ``read_job``)."""
    before = None if cursor is None else int(cursor)
    if before is not None and before > INT64_MAX:
        raise ApiError(422, "invalid_request", f"The request is invalid: query.cursor: must be at most {INT64_MAX}.")
    rows, next_cursor = store_of(request).list_job_rows(statuses=status, before=before, limit=limit)
    body = answers_of(request).page_json(rows, next_cursor, include_spec=include_spec)
    return Response(body, media_type="application/json")


@router.get("/{job_id}", response_model=JobPublic, responses=_ERRORS)
async def read_job(job_id: str, request: Request) -> Response:
    """One job: status, progress, latest metrics and memory, error, worker and GPU, spec."""
    # The hottest route (dashboards poll it). A WAL read never waits on the job's writes and costs less
    # than the hop to the thread pool it would otherwise take. The store comes from the request, not
    # StoreDep: resolving a dependency costs a poll more than its own read; and the answer is built once
    # per change of the job's row (job_answers.py). Both measured with bench/profile_requests.py.
    body = answers_of(request).json_of(store_of(request).get_job_row(job_id), include_spec=True)
    return Response(body, media_type="application/json")


@router.post("/{job_id}/cancel", responses=_ERRORS)
def cancel_job(job_id: str, store: StoreDep, scheduler: SchedulerDep, settings: SettingsDep) -> JobPublic:
    """Cancel now; a running job is stopped within FERRY_CANCEL_GRACE_S (``stop_requested: cancel``).
    Works on a full disk too (disk.py)."""
    job = with_space_to_free(settings.data_dir, lambda: store.cancel(job_id))
    scheduler.wake()
    return JobPublic.from_record(job)


@router.post("/{job_id}/pause", responses=_ERRORS)
def pause_job(job_id: str, store: StoreDep, scheduler: SchedulerDep) -> JobPublic:
    """Pause: a running job checkpoints at its next step and frees its slot."""
    job = store.pause(job_id)
    scheduler.wake()
    return JobPublic.from_record(job)


@router.post("/{job_id}/resume", responses=_ERRORS)
def resume_job(job_id: str, store: StoreDep, scheduler: SchedulerDep, settings: SettingsDep) -> JobPublic:
    """Queue a paused, interrupted or failed job again; it continues from its last checkpoint. A resume by
    hand starts the automatic retries afresh."""
    store.get_job(job_id)  # 404 before 507
    refuse_if_disk_low(settings.data_dir, settings.min_free_disk_bytes)
    job = store.resume(job_id)
    scheduler.wake()
    return JobPublic.from_record(job)


@router.delete("/{job_id}", status_code=204, responses=_ERRORS)
def delete_job(job_id: str, store: StoreDep, settings: SettingsDep) -> Response:
    """Delete a finished job with its events, checkpoints and logs; works on a full disk too (disk.py)."""
    with_space_to_free(settings.data_dir, lambda: store.delete_job(job_id))
    shutil.rmtree(settings.job_dir(job_id), ignore_errors=True)
    return Response(status_code=204)
