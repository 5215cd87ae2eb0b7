"""FastAPI dependencies as typed aliases, so routes read like sentences and never touch globals."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from .devices import GpuMonitor
from .errors import ApiError
from .scheduler import Scheduler
from .settings import Settings
from .spec_checker import SpecChecker
from .store import JobStore


# Dependencies are `async def` although they never await: a plain `def` would cost a hop to the thread
# pool on every request, which dominates the cost of the hot read routes.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> JobStore:
    return request.app.state.store


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
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
GpuMonitorDep = Annotated[GpuMonitor, Depends(get_gpu_monitor)]
SpecCheckerDep = Annotated[SpecChecker, Depends(get_spec_checker)]


async def require_token(request: Request, settings: SettingsDep) -> None:
    """With FERRY_API_TOKEN set, every /v1 route needs ``Authorization: Bearer <token>``."""
    if settings.api_token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not given:
        raise ApiError(
            401,
            "unauthorized",
            "This service needs a token: send the header "
            "'Authorization: Bearer <token>' with the value of FERRY_API_TOKEN.",
            headers=challenge,
        )
    # Constant time: how much of a guess matches must not show in the response time.
    if not hmac.compare_digest(given.strip().encode(), settings.api_token.get_secret_value().encode()):
        raise ApiError(
            401, "unauthorized", "The bearer token is wrong; send the value of FERRY_API_TOKEN.", headers=challenge
        )
