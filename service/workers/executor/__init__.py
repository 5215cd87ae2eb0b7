"""How a job is launched: one small interface, a local spawned process per slot today."""

from service.workers.executor.base import Executor, LaunchRequest, RunHandle
from service.workers.executor.local import LocalProcessExecutor

__all__ = ["Executor", "LaunchRequest", "LocalProcessExecutor", "RunHandle"]
