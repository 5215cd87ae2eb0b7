"""FastAPI dependencies as typed aliases, so routes read like sentences and never touch globals."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.api.job_answers import JobAnswers
from service.checking.checker import SpecChecker
from service.queue.files import FileStore
from service.queue.fine_tuning import FineTuningStore
from service.queue.store import JobStore
from service.settings import Settings
from service.workers.devices import GpuMonitor
from service.workers.scheduler import Scheduler


# Dependencies are `async def` although they never await: a plain `def` would cost a hop to the thread
# pool on every request, which dominates the cost of the hot read routes.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def store_of(request: Request) -> JobStore:
    """The store, for the hot polls that take ``request`` instead of ``StoreDep`` (see routes/jobs.read_job)."""
    return request.app.state.store


def answers_of(request: Request) -> JobAnswers:
    """The jobs' JSON answers kept for the hot polls (job_answers.py)."""
    return request.app.state.job_answers


async def get_store(request: Request) -> JobStore:
    return store_of(request)


async def get_files(request: Request) -> FileStore:
    return request.app.state.files


async def get_fine_tuning(request: Request) -> FineTuningStore:
    return request.app.state.fine_tuning


async def get_scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def get_spec_checker(request: Request) -> SpecChecker:
    return request.app.state.spec_checker


async def get_gpu_monitor(request: Request) -> GpuMonitor:
    return request.app.state.gpu_monitor


async def read_body(request: Request) -> bytes:
    """The raw body, read in the event loop so the handler can run in the thread pool."""
    return await request.body()


SpecBody = Annotated[bytes, Depends(read_body)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[JobStore, Depends(get_store)]
FilesDep = Annotated[FileStore, Depends(get_files)]
FineTuningDep = Annotated[FineTuningStore, Depends(get_fine_tuning)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
GpuMonitorDep = Annotated[GpuMonitor, Depends(get_gpu_monitor)]
SpecCheckerDep = Annotated[SpecChecker, Depends(get_spec_checker)]
