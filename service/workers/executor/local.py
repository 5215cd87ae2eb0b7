"""Run each job in its own spawned process on this machine."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal

import psutil

from service.workers.executor.base import LaunchRequest, StopKind
from service.workers.executor.child import STOP_CANCEL, STOP_PAUSE, run_child
from service.workers.executor.spares import SPAWN, SlotKey, Spare, SparePool


class LocalProcessHandle:
    """A spawned process plus the shared flag it polls between steps."""

    def __init__(
        self, process: mp.process.BaseProcess, stop_flag: mp.sharedctypes.Synchronized[int], *, warm: bool = False
    ) -> None:
        self._process = process
        self._stop_flag = stop_flag
        self.warm = warm  # the job went to a spare whose imports were done before it arrived
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
        return f"LocalProcessHandle(pid={self.pid}, warm={self.warm}, exit_code={self.exit_code()})"


class LocalProcessExecutor:
    """One spawned child process per job, running ``jobs.run_job``.

    With ``warm``, each of those slots keeps a spare process that has already imported torch and ``jobs``
    (seconds of start-up) and waits for its slot's next job (spares.py); it is still one fresh process per
    job. A slot's spare is replaced after each hand-over and whenever it dies (``keep_warm``).

    Example:
        executor = LocalProcessExecutor(warm=[("0", None)])   # a spare for GPU 0
        handle = executor.launch(request)
        handle.request_stop("pause")
    """

    def __init__(self, warm: list[SlotKey] | None = None) -> None:
        self._pool = SparePool(warm or [])

    def launch(self, request: LaunchRequest) -> LocalProcessHandle:
        spare = self._pool.take((request.device, request.cpu_threads))
        if spare is not None and spare.take(request):
            return LocalProcessHandle(spare.process, spare.stop_flag, warm=spare.ready_at is not None)
        stop_flag = SPAWN.Value("i", 0, lock=False)  # one writer (us), one reader (the child)
        process = SPAWN.Process(
            target=run_child, args=(request, stop_flag), name=f"ferry-job-{request.job_id}", daemon=False
        )
        process.start()
        return LocalProcessHandle(process, stop_flag)

    def keep_warm(self) -> None:
        """Start the spares that are due: after a hand-over, or in place of one that died."""
        self._pool.keep_warm()

    def spares(self) -> list[Spare]:
        """The spare processes now, ready or importing."""
        return self._pool.spares()

    def close(self) -> None:
        """End the spares; running jobs are the scheduler's to stop."""
        self._pool.close()

    def stop_orphan(self, pid: int | None, started_at: float | None, *, grace_s: float) -> None:
        # An orphan pauses itself when its parent dies (it watches getppid), so it usually leaves on its own.
        process = same_process(pid, started_at)
        if process is None:
            return
        try:
            process.wait(timeout=grace_s)
        except psutil.TimeoutExpired:
            process.kill()
        except psutil.Error:
            pass


def same_process(pid: int | None, started_at: float | None) -> psutil.Process | None:
    """The process ``pid`` if it is the one that started at ``started_at``: the OS reuses pids."""
    if pid is None or started_at is None:
        return None
    try:
        process = psutil.Process(pid)
        return process if abs(process.create_time() - started_at) < 1.0 else None
    except psutil.Error:
        return None
