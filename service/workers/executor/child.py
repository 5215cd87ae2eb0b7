"""The entry point of a job's spawned process: run ``jobs.run_job`` and write its events to the store.

Nothing heavy is imported at module level: ``CUDA_VISIBLE_DEVICES`` must be set before torch starts CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from time import sleep
from typing import Any, Protocol

from jobs.paths import PathRoots, without_roots
from service.queue.db import is_locked
from service.workers.executor.base import LaunchRequest

STOP_NONE, STOP_PAUSE, STOP_CANCEL = 0, 1, 2
SPARE_NAME, JOB_NAME = "ferry-spare", "ferry-job"  # the process names ps shows (at most 15 bytes)
PR_SET_NAME = 15  # prctl(2)

log = logging.getLogger("ferry.job")


def run_child(request: LaunchRequest, stop_flag: Any) -> None:
    """Run one attempt of a job; exit code 0 when it ended by itself (succeeded, paused, cancelled)."""
    parent = os.getppid()
    _prepare_process(request.device, request.cpu_threads)
    _name_process(JOB_NAME)
    _run_prepared(request, stop_flag, parent, origin="a fresh process")


def run_spare(device: str | None, cpu_threads: int | None, conn: Connection, stop_flag: Any) -> None:
    """A process started ahead of its job: import the heavy modules, say so, then wait for one job and run it.

    Importing torch and ``jobs`` is most of a job's start-up time; a spare has done it before the job
    arrives. Importing does not initialise CUDA, so the GPU pinning still holds.
    """
    parent = os.getppid()
    _prepare_process(device, cpu_threads)
    _name_process(SPARE_NAME)
    _import_what_a_job_needs()
    ready_at = time.time()
    early = conn.poll()  # the job came while we imported: it waited for them
    # Ready: the pool reads it without waiting. A job handed over during the imports is in the pipe already,
    # and the server has closed its end, so this send may fail; the recv below still gets the job.
    with contextlib.suppress(OSError):
        conn.send(ready_at)
    try:
        request = conn.recv()
    except (EOFError, OSError):  # the server stopped or died before it had a job for us
        os._exit(0)
    if os.getppid() != parent:  # handed over, then the server died: the next server requeues the job
        os._exit(0)
    assert (request.device, request.cpu_threads) == (device, cpu_threads), "a spare runs only its slot's jobs"
    _name_process(JOB_NAME)
    origin = (
        "a spare process that was still importing when the job arrived"
        if early
        else f"a warm process: its imports finished at {ready_at:.3f}, {time.time() - ready_at:.1f} s before the job"
    )
    _run_prepared(request, stop_flag, parent, origin=origin)


def _import_what_a_job_needs() -> None:
    """Everything a job imports before its first step, so that a job in a spare imports nothing."""
    import importlib.util

    # The first optimizer a process builds imports torch._dynamo, which takes seconds.
    import torch._dynamo

    import jobs.spec.rules  # noqa: F401 - the cross-section rules, imported by the first spec a process loads
    from jobs import PathRoots, load_job_spec, run_job  # noqa: F401 - the names `_run` calls
    from jobs.data import prepare, synthetic, text  # noqa: F401 - the data sources jobs.data imports on first use
    from jobs.fit import budget, estimate, host_memory  # noqa: F401 - gpu_memory_budget: auto, decided as the fit check does
    from service.queue.store import JobStore  # noqa: F401 - where the job's events go

    if importlib.util.find_spec("tensorboard") is not None:  # jobs.reporting.tracking writes TensorBoard by default
        import torch.utils.tensorboard  # noqa: F401


def _name_process(name: str) -> None:
    """Show ``name`` for this process in ps, top and psutil (Linux): a spare and a job are told apart there."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _prepare_process(device: str | None, cpu_threads: int | None) -> None:
    # Pin the process to its GPU before anything can initialise CUDA; "" hides every GPU from a CPU job.
    # PCI order makes the index mean the same GPU as in nvidia-smi, where the slots came from.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = device if device is not None else ""
    if device is not None:
        # Read when CUDA starts: with expandable segments the allocator grows its mappings instead of keeping
        # fixed-size blocks, so what a step reserves stays near what it allocates. Without it, the gap between
        # the two on a large model is room a memory budget could hold weights in (``gpu_memory_budget: auto``
        # measures the peak reserved). A setting of the user's own wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if cpu_threads is not None:  # a CPU job: read by torch when it starts its thread pools
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(cpu_threads)
        os.nice(5)  # when cores are short, the API answering beats a CPU job's next step
    # Ctrl-C in the server's terminal reaches the whole process group; the server decides how we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_prepared(request: LaunchRequest, stop_flag: Any, parent: int, *, origin: str) -> None:
    """Run the job in this process, prepared for it; ``parent`` is the server, whose death means pause."""
    log_to_file(request)

    from service.queue.store import JobStore  # after the environment is set

    log.info(
        "job %s attempt %d starting in pid %d with CUDA_VISIBLE_DEVICES=%r (%s)",
        request.job_id,
        request.attempt,
        os.getpid(),
        os.environ["CUDA_VISIBLE_DEVICES"],
        origin,
    )
    store = JobStore(request.db_path)
    # The server records our pid once launch returns; should it die first, a restarted server would not know
    # this process and could run the job again beside it. So the process records itself while its server
    # lives (a new server starts only after the old one is gone, and reads the pids then), and leaves at
    # once if the job is no longer this attempt's.
    registered = os.getppid() == parent and store.register_process(
        request.job_id, request.attempt, pid=os.getpid(), started_at=_start_time()
    )
    if not registered:
        log.info("job %s attempt %d was taken back before it started; leaving", request.job_id, request.attempt)
        store.close()
        logging.shutdown()
        os._exit(0)

    def should_stop() -> str | None:
        if os.getppid() != parent:  # the server died: checkpoint and leave; the next server resumes us
            return "pause"
        return {STOP_PAUSE: "pause", STOP_CANCEL: "cancel"}.get(stop_flag.value)

    code = run_attempt(request, store, should_stop)
    store.close()
    logging.shutdown()
    sys.stdout.flush()
    # Everything is in the store and the log. Skip interpreter teardown, which can take seconds after
    # torch and friends; the slot is free as soon as this process is gone.
    os._exit(code)


def _start_time() -> float | None:
    """This process's start time as psutil reports it (what the server stores beside the pid)."""
    import psutil

    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return None


class EventSink(Protocol):
    """Where a job's events go: the store (a local child) or the Ray task's buffer the service drains."""

    def append_events(self, job_id: str, attempt: int, events: list[Any]) -> Any:
        """Keep ``events`` (wire dicts), in order, for ``job_id``'s ``attempt``."""
        ...


def run_attempt(request: LaunchRequest, sink: EventSink, should_stop: Callable[[], str | None]) -> int:
    """Run one attempt, giving every event to ``sink.append_events(job_id, attempt, events)``.

    Returns 0 when the job ended by itself (succeeded, paused, cancelled) and 1 when it raised; either way
    its last event (``finished`` or ``failed``) has been given to ``sink``. The local child passes the
    store; a Ray task passes a buffer the service drains.
    """
    reporter = EventReporter(sink, request)
    try:
        outcome = _run(request, reporter, should_stop)
        reporter.finished(outcome.status, outcome.step)
        return 0
    except BaseException as error:
        log.exception("job %s failed", request.job_id)
        reporter.failed(error)
        return 1


def _run(request: LaunchRequest, reporter: EventReporter, should_stop: Any) -> Any:
    from jobs import PathRoots, load_job_spec, run_job
    from jobs.fit.disk_tier import with_host_memory_limit

    roots = PathRoots(model_roots=request.model_roots, data_roots=request.data_roots)
    # The server's share of its host memory budget, for a job that sets no limit of its own.
    spec = with_host_memory_limit(load_job_spec(request.spec_text, roots=roots), request.host_memory_limit)
    request.output_dir.mkdir(parents=True, exist_ok=True)
    return run_job(
        spec,
        output_dir=request.output_dir,
        report=reporter,
        resume=True,
        should_stop=should_stop,
        cache_dir=request.cache_dir,
    )


class EventReporter:
    """The ``report`` callback: each typed event is serialized and written to the sink (the store).

    Step events are written in small batches (one transaction per ``BATCH_S`` or ``BATCH_STEPS`` steps,
    the first at once); every other event is written at once, after the steps before it. A crash loses at
    most the last batch of steps, which the resume from the last checkpoint re-runs anyway. Each step (at
    most one line per ``LOG_STEP_S``), checkpoint and the outcome also go to job.log. An event
    jobs/events.py does not declare is refused here.
    """

    BATCH_S, BATCH_STEPS, LOG_STEP_S = 0.25, 64, 2.0
    FINAL_WAIT_S = 600.0  # the outcome's write waits this long for a locked database

    def __init__(self, store: EventSink, request: LaunchRequest) -> None:
        self._store, self._request = store, request
        self._roots = PathRoots(model_roots=request.model_roots, data_roots=request.data_roots)
        self._ended = False
        self._stepped = False  # the attempt's first step goes out at once, however soon after `started`
        self._pending: list[dict[str, Any]] = []
        self._flushed_at = self._step_logged_at = float("-inf")

    def __call__(self, event: Any) -> None:
        from jobs.events import event_to_wire

        wire = event_to_wire(event)
        if wire["type"] in ("failed", "log"):  # the user reads these: paths as the spec wrote them
            wire["message"] = without_roots(wire["message"], self._roots)
        self._log(wire)
        self._pending.append(wire)
        if wire["type"] in ("finished", "failed"):
            self._ended = True
        first_step = wire["type"] == "step" and not self._stepped
        self._stepped = self._stepped or wire["type"] == "step"
        if (
            wire["type"] != "step"
            or first_step
            or len(self._pending) >= self.BATCH_STEPS
            or time.monotonic() - self._flushed_at >= self.BATCH_S
        ):
            self.flush()

    def flush(self, *, final: bool = False) -> None:
        """Write the pending events. While another connection holds the database's lock past the busy timeout,
        they stay pending and training goes on: the next event tries again. The ``final`` flush (the outcome)
        waits for the lock, with backoff, up to ``FINAL_WAIT_S``: a lock must not fail a running job."""
        if not self._pending:
            return
        deadline, wait = time.monotonic() + self.FINAL_WAIT_S, 0.05
        while True:
            try:
                self._store.append_events(self._request.job_id, self._request.attempt, self._pending)
                break
            except sqlite3.OperationalError as error:
                if not is_locked(error) or (final and time.monotonic() >= deadline):
                    raise
                log.warning("the job database is locked; %d event(s) kept to write later", len(self._pending))
                if not final:
                    self._flushed_at = time.monotonic()  # the next try at the next step, not at once
                    return
                sleep(wait)
                wait = min(wait * 2, 2.0)
        self._pending = []
        self._flushed_at = time.monotonic()

    def finished(self, status: str, step: int) -> None:
        from jobs.events import FinishedEvent

        if not self._ended:
            self(FinishedEvent(status=status, step=step))  # type: ignore[arg-type]
        self.flush(final=True)

    def failed(self, error: BaseException) -> None:
        from jobs.events import failed_event

        if not self._ended:  # e.g. the spec was refused before run_job started
            self(failed_event(error))
        self.flush(final=True)

    def _log(self, wire: dict[str, Any]) -> None:
        kind = wire["type"]
        if kind == "step" and time.monotonic() - self._step_logged_at >= self.LOG_STEP_S:
            self._step_logged_at = time.monotonic()
            log.info(
                "step %d/%d loss %.6g lr %.3g %.1f samples/s",
                wire["step"], wire["total_steps"], wire["loss"], wire["lr"], wire["samples_per_s"],
            )  # fmt: skip
        elif kind == "checkpoint":
            log.info("checkpoint %s at step %d written to %s", wire["name"], wire["step"], wire["path"])
        elif kind == "finished":
            log.info("job %s finished: %s at step %d", self._request.job_id, wire["status"], wire["step"])
        elif kind == "failed":
            log.info("job %s failed: %s", self._request.job_id, wire.get("message"))


def log_to_file(request: LaunchRequest, *, capture_stdio: bool = True) -> None:
    """Send this process's logging (and, with ``capture_stdio``, its stdout and stderr) to the job's log file."""
    request.log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(request.log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    if not capture_stdio:  # a Ray worker: its stdout already goes to Ray's own logs
        return
    # Stray prints and tracebacks from libraries end up in the same file.
    stream = open(request.log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    sys.stdout = sys.stderr = stream
