"""Run each job in its own spawned process on this machine."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import psutil

from .base import LaunchRequest, StopKind
from .child import STOP_CANCEL, STOP_PAUSE, run_child

# CUDA does not survive fork(): every job gets a fresh interpreter.
_SPAWN = mp.get_context("spawn")


class LocalProcessHandle:
    """A spawned process plus the shared flag it polls between steps."""

    def __init__(self, process: mp.process.BaseProcess, stop_flag: "mp.sharedctypes.Synchronized[int]") -> None:
        self._process = process
        self._stop_flag = stop_flag
        self.pid = process.pid
        try:
            self.started_at: float | None = psutil.Process(process.pid).create_time()
        except psutil.Error:
            self.started_at = None

    def exit_code(self) -> int | None:
        return self._process.exitcode

    def request_stop(self, kind: StopKind) -> None:
        self._stop_flag.value = STOP_CANCEL if kind == "cancel" else STOP_PAUSE

    def kill(self) -> None:
        if self._process.exitcode is None and self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self) -> None:
        """Collect the exit status so no zombie is left behind."""
        self._process.join(timeout=0)

    def __repr__(self) -> str:
        return f"LocalProcessHandle(pid={self.pid}, exit_code={self.exit_code()})"


class LocalProcessExecutor:
    """One spawned child process per job, running ``jobs.run_job``.

    Example:
        handle = LocalProcessExecutor().launch(request)
        handle.request_stop("pause")
    """

    def launch(self, request: LaunchRequest) -> LocalProcessHandle:
        stop_flag = _SPAWN.Value("i", 0, lock=False)  # one writer (us), one reader (the child)
        process = _SPAWN.Process(
            target=run_child, args=(request, stop_flag), name=f"ferry-job-{request.job_id}", daemon=False
        )
        process.start()
        return LocalProcessHandle(process, stop_flag)
