"""How a job is launched: one small interface, a local spawned process per slot today."""

from .base import Executor, LaunchRequest, RunHandle
from .local import LocalProcessExecutor

__all__ = ["Executor", "LaunchRequest", "LocalProcessExecutor", "RunHandle"]
