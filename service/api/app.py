"""The FastAPI application: ``create_app(settings)`` for tests and embedding, ``app`` for uvicorn."""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.api.access import AccessMiddleware
from service.api.body_limit import BodyLimitMiddleware
from service.api.errors import install_error_handlers
from service.api.job_answers import JobAnswers
from service.api.openai.errors import install_openai_http_errors
from service.api.routes import checkpoints, conversions, events, files, fine_tuning, health, jobs, samples, workers
from service.checking.checker import SpecChecker, SpecCheckerProcess
from service.dashboard import mount_dashboard
from service.queue.data_dir import DataDirLock, make_private
from service.queue.disk import ensure_reserve
from service.queue.files import FileStore
from service.queue.fine_tuning import FineTuningStore
from service.queue.store import JobStore
from service.settings import Settings
from service.uploads.receive import clean_incoming
from service.workers.devices import GpuMonitor, Slot, plan_slots, query_gpus, threads_for
from service.workers.executor import Executor, LocalProcessExecutor
from service.workers.scheduler import Scheduler

log = logging.getLogger("ferry")


def create_app(
    settings: Settings | None = None,
    *,
    executor: Executor | None = None,
    gpu_monitor: GpuMonitor | None = None,
    spec_checker: SpecChecker | None = None,
) -> FastAPI:
    """Build the service. The store opens, the spec checker and the workers start in the lifespan, not at import.

    A ``spec_checker`` given here is the caller's to close (tests share one across apps); by default the app
    starts its own process (service/checking/checker.py) and stops it on shutdown.

    Example:
        app = create_app(Settings(data_dir=tmp_path))
        uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    settings = settings or Settings()
    gpu_monitor = gpu_monitor or GpuMonitor(query_gpus)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        make_private(settings.data_dir, settings.storage_dir)
        lock = DataDirLock.acquire(settings.data_dir)  # a second server on this directory stops here
        clean_incoming(settings.uploads_dir, settings.incoming_uploads_dir)  # partial uploads of a killed server
        checker = spec_checker or SpecCheckerProcess(
            timeout_s=settings.spec_check_timeout_s, memory_bytes=settings.spec_check_memory_bytes
        )
        checker.start()  # imports torch in its own process while this one carries on
        store = JobStore(settings.db_path, busy_timeout_s=settings.db_busy_timeout_s)  # the schema on a fresh start
        ensure_reserve(settings.data_dir)  # room for cancel and delete should the disk fill up (disk.py)
        if executor is None and settings.executor == "ray":
            runner, slots = _ray_executor(settings)
        else:
            slots = plan_slots(settings, gpu_monitor.gpus())
            runner = executor or _local_executor(settings, slots)
        scheduler = Scheduler(store, runner, slots, settings)
        app.state.settings, app.state.store, app.state.scheduler = settings, store, scheduler
        app.state.gpu_monitor, app.state.spec_checker = gpu_monitor, checker
        app.state.files, app.state.fine_tuning = FileStore(store.db), FineTuningStore(store.db)
        scheduler.start()
        log.info("Ferry ready: data in %s, workers %s", settings.data_dir.resolve(), [s.id for s in slots])
        # What start-up built (modules, routes, pydantic's validators) lives as long as the server: out of
        # the collector's sight, a full collection no longer walks it (a pause on every request it hits).
        gc.collect()
        gc.freeze()
        switch_interval = sys.getswitchinterval()
        # A thread that holds the GIL (a stream rendering a catch-up batch, the scheduler) keeps the event
        # loop waiting up to the switch interval on each request it serves: a fifth of Python's default interval.
        sys.setswitchinterval(0.001)
        try:
            yield
        finally:
            scheduler.stop()  # running jobs checkpoint and go back to the queue
            runner.close()
            if spec_checker is None:
                checker.close()
            store.close()
            lock.release()
            gc.unfreeze()
            sys.setswitchinterval(switch_interval)

    app = FastAPI(
        title="Ferry",
        version="0.1.0",
        lifespan=lifespan,
        description="Submit YAML training jobs; follow their progress; download checkpoints.",
        # FastAPI's native OpenTelemetry looks up the global providers on every request (a share of each
        # poll's CPU, bench/profile_requests.py); Ferry exports Prometheus metrics instead.
        telemetry={"tracing": False, "metrics": False, "logs": False},
        openapi_url=None,  # set below, after the API's routes: FastAPI matches routes in order
    )
    uploads = {"/v1/files": (settings.max_upload_bytes, "FERRY_MAX_UPLOAD_BYTES")}  # uploads have a limit of their own
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, path_limits=uploads)
    token = settings.api_token.get_secret_value() if settings.api_token else None
    app.add_middleware(AccessMiddleware, token=token)  # outermost: peer and token before anything reads the request
    install_error_handlers(app)
    install_openai_http_errors(app)  # 404/405 under /v1/fine_tuning in OpenAI's envelope
    app.state.job_answers = JobAnswers()  # each job's JSON, kept while its row is unchanged

    # Straight into the app, not through a /v1 router of their own: FastAPI matches an included router's
    # routes level by level, and a level costs each request a measurable share (bench/profile_requests.py).
    # The token is checked by AccessMiddleware.
    for module in (jobs, events, samples, checkpoints, workers, files, fine_tuning, conversions):
        app.include_router(module.router, prefix="/v1")
    app.include_router(health.router)
    app.include_router(health.metrics_router)
    # /openapi.json, /docs and /redoc behind the API, not before it as FastAPI adds them: each poll was
    # matched against those four first.
    app.openapi_url = "/openapi.json"
    app.setup()
    mount_dashboard(app)  # the browser pages at /ui/; they read /v1 with the user's token
    return app


def _local_executor(settings: Settings, slots: list[Slot]) -> LocalProcessExecutor:
    warm = [(slot.device, threads_for(slot, slots, os.cpu_count())) for slot in slots] if settings.warm_start else []
    return LocalProcessExecutor(warm=warm)


def _ray_executor(settings: Settings) -> tuple[Executor, list[Slot]]:
    """Join the Ray cluster; one slot per job Ferry hands to it at once (its GPUs, unless told otherwise)."""
    try:
        from service.workers.executor.ray_executor import (
            RayExecutor,  # Ray is an optional extra, imported only when chosen
        )
    except ImportError as error:
        raise RuntimeError(
            f"FERRY_EXECUTOR=ray needs Ray on this machine and every node: pip install -e '.[ray]' ({error})"
        ) from error

    runner = RayExecutor(address=settings.ray_address, db_path=settings.db_path, cpus_per_job=settings.ray_cpus_per_job)
    count = settings.ray_max_jobs or runner.gpu_count() or settings.cpu_workers
    if settings.shared_dir is None:
        log.warning(
            "FERRY_EXECUTOR=ray without FERRY_SHARED_DIR: job outputs go to %s, which only works when "
            "every Ray node sees that path",
            settings.data_dir.resolve(),
        )
    return runner, [Slot(id=f"ray{n}", device=None) for n in range(count)]


app = create_app()  # `uvicorn service.api.app:app`; settings from FERRY_* variables
