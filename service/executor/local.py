"""Run each job in its own spawned process on this machine."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import psutil

from .base import LaunchRequest, StopKind
from .child import STOP_CANCEL, STOP_PAUSE, run_child, run_spare

# CUDA does not survive fork(): every job gets a fresh interpreter.
_SPAWN = mp.get_context("spawn")


class LocalProcessHandle:
    """A spawned process plus the shared flag it polls between steps."""

    def __init__(self, process: mp.process.BaseProcess, stop_flag: mp.sharedctypes.Synchronized[int]) -> None:
        self._process = process
        self._stop_flag = stop_flag
        self.pid = process.pid
        try:
            self.started_at: float | None = psutil.Process(process.pid).create_time()
        except psutil.Error:
            self.started_at = None

    def exit_code(self) -> int | None:
        return self._process.exitcode

    def exit_reason(self) -> str | None:
        return None  # the exit code says it all

    def request_stop(self, kind: StopKind) -> None:
        self._stop_flag.value = STOP_CANCEL if kind == "cancel" else STOP_PAUSE

    def kill(self) -> None:
        if self._process.exitcode is None and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def reap(self) -> None:
        """Collect the exit status so no zombie is left behind."""
        self._process.join(timeout=0)

    def __repr__(self) -> str:
        return f"LocalProcessHandle(pid={self.pid}, exit_code={self.exit_code()})"


class _Spare:
    """A spawned process warming up for a slot, and the pipe that will hand it its job."""

    def __init__(self, process: mp.process.BaseProcess, outbox: Connection, stop_flag: Any) -> None:
        self.process, self.outbox, self.stop_flag = process, outbox, stop_flag

    @classmethod
    def start(cls, device: str | None, cpu_threads: int | None) -> _Spare:
        inbox, outbox = _SPAWN.Pipe(duplex=False)
        stop_flag = _SPAWN.Value("i", 0, lock=False)
        process = _SPAWN.Process(
            target=run_spare,
            args=(device, cpu_threads, inbox, stop_flag),
            name=f"ferry-spare-{device or 'cpu'}",
            daemon=False,
        )
        process.start()
        inbox.close()  # the child holds the only reader, so it sees EOF when we go away
        return cls(process, outbox, stop_flag)

    def take(self, request: LaunchRequest) -> bool:
        """Hand over the job; False if the spare has died meanwhile."""
        if self.process.exitcode is not None:
            return False
        try:
            self.outbox.send(request)
        except OSError:
            return False
        self.outbox.close()
        return True

    def discard(self) -> None:
        """It holds no job, so there is nothing to lose by killing it."""
        self.outbox.close()
        self.process.kill()
        self.process.join()


class LocalProcessExecutor:
    """One spawned child process per job, running ``jobs.run_job``.

    With ``warm`` on, each slot keeps one spare process that has already imported torch and ``jobs``
    (seconds of start-up) and waits for its slot's next job; it is still one fresh process per job.

    Example:
        executor = LocalProcessExecutor(warm=[("0", None)])   # a spare for GPU 0
        handle = executor.launch(request)
        handle.request_stop("pause")
    """

    def __init__(self, warm: list[tuple[str | None, int | None]] | None = None) -> None:
        self._warm = set(warm or [])
        self._spares: dict[tuple[str | None, int | None], _Spare] = {}
        for key in self._warm:
            self._spares[key] = _Spare.start(*key)

    def launch(self, request: LaunchRequest) -> LocalProcessHandle:
        key = (request.device, request.cpu_threads)
        spare = self._spares.pop(key, None)
        if key in self._warm:
            self._spares[key] = _Spare.start(*key)  # ready for this slot's next job
        if spare is not None and spare.take(request):
            return LocalProcessHandle(spare.process, spare.stop_flag)
        stop_flag = _SPAWN.Value("i", 0, lock=False)  # one writer (us), one reader (the child)
        process = _SPAWN.Process(
            target=run_child, args=(request, stop_flag), name=f"ferry-job-{request.job_id}", daemon=False
        )
        process.start()
        return LocalProcessHandle(process, stop_flag)

    def close(self) -> None:
        """End the spares (they exit when their pipe closes)."""
        for spare in self._spares.values():
            spare.discard()
        self._spares.clear()

    def stop_orphan(self, pid: int | None, started_at: float | None, *, grace_s: float) -> None:
        # An orphan pauses itself when its parent dies (it watches getppid), so it usually leaves on its own.
        process = _same_process(pid, started_at)
        if process is None:
            return
        try:
            process.wait(timeout=grace_s)
        except psutil.TimeoutExpired:
            process.kill()
        except psutil.Error:
            pass


def _same_process(pid: int | None, started_at: float | None) -> psutil.Process | None:
    """The process ``pid`` if it is the one that started at ``started_at``: the OS reuses pids."""
    if pid is None or started_at is None:
        return None
    try:
        process = psutil.Process(pid)
        return process if abs(process.create_time() - started_at) < 1.0 else None
    except psutil.Error:
        return None
