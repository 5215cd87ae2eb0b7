"""/health (the process answers), /ready (store and queue work) and /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.deps import SchedulerDep, SettingsDep, SpecCheckerDep, StoreDep
from service.api.prometheus import render_metrics
from service.queue.disk import low_disk_message

router = APIRouter(tags=["health"])
# /metrics names jobs and their figures, so it takes the token too when one is set (access.py).
metrics_router = APIRouter(tags=["health"])


@router.get("/health")
def health() -> dict[str, str]:
    """Liveness: the server answers."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "recovering, or the store or queue is down"}})
def ready(store: StoreDep, scheduler: SchedulerDep, settings: SettingsDep, checker: SpecCheckerDep) -> JSONResponse:
    """Readiness: the store answers, start-up recovery is done, the queue thread runs, the spec checker has
    started (submits need it) and the disk has room."""
    try:
        store.count_by_status()
    except Exception as error:
        return JSONResponse({"status": "unavailable", "reason": f"store: {error}"}, status_code=503)
    if not scheduler.ready.is_set():
        return JSONResponse({"status": "starting", "reason": "recovering interrupted jobs"}, status_code=503)
    if not checker.ready:
        if checker.problem:  # submits answer 503 until a checker starts; each one tries a new checker
            reason = f"the spec checker {checker.problem}; see the server log"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "starting", "reason": "the spec checker is starting"}, status_code=503)
    if not scheduler.is_alive():
        return JSONResponse({"status": "unavailable", "reason": "the scheduler thread stopped"}, status_code=503)
    low = low_disk_message(settings.data_dir, settings.min_free_disk_bytes)
    if low is not None:  # reads, cancels and deletes still work; new jobs are refused (507)
        return JSONResponse({"status": "disk_low", "reason": low}, status_code=503)
    return JSONResponse({"status": "ready"})


@metrics_router.get("/metrics", response_class=PlainTextResponse)
def metrics(store: StoreDep, scheduler: SchedulerDep) -> Response:
    """Prometheus text format: jobs by status, busy workers, and the latest figures of running jobs."""
    return Response(render_metrics(store, scheduler), media_type=CONTENT_TYPE_LATEST)
