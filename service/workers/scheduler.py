"""The queue's engine: feeds free slots, watches running jobs, and recovers after a crash."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sqlite3
import threading
import time
from dataclasses import dataclass

from jobs.events import ErrorCode, FailedEvent, FinishedEvent
from service.queue.files import FileStore
from service.queue.records import JobRecord
from service.queue.retention import StepRetention
from service.queue.status import IllegalTransition, JobStatus
from service.queue.store import JobNotFound, JobStore
from service.settings import Settings
from service.uploads.recheck import stale_uploads
from service.workers.devices import Slot, threads_for
from service.workers.executor import Executor, LaunchRequest, RunHandle
from service.workers.placement import Placement, gpus_needed

log = logging.getLogger("ferry.scheduler")
_HONOURED = {"cancel": (JobStatus.CANCELLED, "cancelled"), "pause": (JobStatus.PAUSED, "paused")}


@dataclass
class Running:
    """A job occupying a slot."""

    job_id: str
    attempt: int
    handle: RunHandle
    stop_sent: str | None = None
    kill_at: float | None = None  # monotonic deadline after a cancel
    shutting_down: bool = False
    compacted_id: int = 0  # step events up to here are reduced already (retention.py)
    compacted_at: float = 0.0


class Scheduler:
    """A background thread that runs the queue: one job per slot, oldest queued job first.

    Example:
        scheduler = Scheduler(store, LocalProcessExecutor(), slots, settings)
        scheduler.start()   # recovers jobs left running by a dead server, then runs the queue
        scheduler.stop()    # running jobs checkpoint and go back to the queue
    """

    def __init__(self, store: JobStore, executor: Executor, slots: list[Slot], settings: Settings) -> None:
        self.store, self.executor, self.slots, self.settings = store, executor, slots, settings
        self.running: dict[str, Running] = {}  # by slot id (a job of several GPUs under each of its slots)
        self.placement = Placement()  # which queued job starts on which free slots (placement.py)
        # Ended processes whose outcome could not be written yet (a full disk): retried every tick, so no job
        # stays `running` without a process.
        self.unsettled: list[tuple[Running, int]] = []
        self.retention = StepRetention(settings.events_keep_first_steps, settings.events_step_window)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ferry-scheduler", daemon=True)
        self.ready = threading.Event()  # set once recovery is done

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Tick now rather than at the next poll (a job was queued or a stop requested)."""
        self._wake.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop feeding slots; running jobs checkpoint (up to the shutdown grace) and are requeued."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()

    # -- the loop ----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self.recover()
        except Exception:
            log.exception("recovery failed")
        self.ready.set()
        while not self._stopping.is_set():
            self._wake.clear()  # before the tick, so a wake() during it is not lost
            try:
                self.tick()
            except Exception:
                log.exception("scheduler tick failed")
            self._wake.wait(self.settings.poll_interval_s)
        self._shutdown_running()

    def tick(self) -> None:
        """One pass: collect ended jobs, pass on stop requests, compact step events, start queued jobs, then
        let the executor prepare for the next ones (spare processes)."""
        for run, code in self.unsettled[:]:
            self.unsettled.remove((run, code))
            self._settle(run, code)
        self._collect_ended()
        for run in self.running.values():  # still running
            self._forward_stop(run)
            self._compact(run)
        free = [slot for slot in self.slots if slot.id not in self.running]
        if free and not self._stopping.is_set():
            queued = [job for job in self.store.jobs_with_status(JobStatus.QUEUED) if self._can_ever_run(job)]
            for job, slots in self.placement.choose(queued, free, self.slots):
                self._start(job, slots)
        if not self._stopping.is_set():
            self.executor.keep_warm()

    def _can_ever_run(self, job: JobRecord) -> bool:
        """False (and the job failed) when it needs more GPUs than this host's slots: it would wait for ever."""
        need, gpus = gpus_needed(job, self.slots), sum(slot.device is not None for slot in self.slots)
        if need <= max(gpus, 1):
            return True
        message = f"distributed.world_size={need} needs {need} GPUs of one host; this service has {gpus}"
        with contextlib.suppress(IllegalTransition, JobNotFound):  # cancelled meanwhile
            # Failed as a launch that could not start: claimed (queued -> running), then failed.
            self.store.transition(job.id, JobStatus.RUNNING, reason="claimed to check its GPUs")
            self.store.transition(
                job.id, JobStatus.FAILED, reason="needs more GPUs than this host has",
                error_code=ErrorCode.LAUNCH_FAILED, error_message=message,
            )  # fmt: skip
        return False

    def _start(self, job: JobRecord, slots: list[Slot]) -> None:
        # A job of several GPUs: one worker named after its slots, CUDA_VISIBLE_DEVICES listing their GPUs.
        slot = Slot(id="+".join(s.id for s in slots), device=",".join(s.device for s in slots if s.device) or None)
        # A device: cpu job on a GPU's slot uses no GPU: the job shows what ran it (no GPU index).
        used = None if job.spec.get("device") == "cpu" else slot.device
        try:
            job = self.store.transition(
                job.id, JobStatus.RUNNING, reason=f"started on {slot.id}", worker=slot.id, device=used
            )
        except (IllegalTransition, JobNotFound):  # cancelled or paused since the queue was read
            return
        try:
            stale = self._stale_uploads(job)
            if stale is not None:
                self.store.transition(
                    job.id, JobStatus.FAILED, reason="names an upload that fails today's upload rules",
                    error_code=ErrorCode.INVALID_SPEC, error_message=stale,
                )  # fmt: skip
                return
            handle = self.executor.launch(self._launch_request(job, slot))
        except Exception as error:
            log.exception("could not launch %s", job.id)
            self.store.transition(
                job.id,
                JobStatus.FAILED,
                reason="launch failed",
                error_code=ErrorCode.LAUNCH_FAILED,
                error_message=f"Could not start the job: {error}",
            )
            return
        self.store.set_process(job.id, pid=handle.pid, started_at=handle.started_at)
        run = Running(job.id, job.attempt, handle)
        for held in slots:
            self.running[held.id] = run
        log.info("started %s attempt %d on %s (pid %s)", job.id, job.attempt, slot.id, handle.pid)

    def _stale_uploads(self, job: JobRecord) -> str | None:
        """Why the job must not train on the uploads it names, or None: a job queued before an upgrade of the
        upload rules names files only older rules checked; each is read again by today's (once per file and
        rules version, uploads/recheck.py) as at submit, so it trains only on what today's server would accept.
        The read runs on the scheduler's thread: seconds for a file of tens of MB, once."""
        failing = stale_uploads(
            job.spec,
            FileStore(self.store.db),
            uploads_dir=self.settings.uploads_dir,
            max_line_bytes=self.settings.max_upload_line_bytes,
        )
        if not failing:
            return None
        said = "; ".join(f"{spec_path}: {fails}" for spec_path, fails in failing)
        return f"this job was queued before the server's upload rules changed, and {said}; then submit the job again"

    def _launch_request(self, job: JobRecord, slot: Slot) -> LaunchRequest:
        job_dir = self.settings.job_dir(job.id)
        return LaunchRequest(
            job_id=job.id,
            attempt=job.attempt,
            spec_text=job.spec_text,
            output_dir=job_dir / "output",
            device=slot.device,
            db_path=self.settings.db_path,
            log_path=job_dir / "job.log",
            # CPU jobs share the cores and leave one to the server, which must keep answering.
            cpu_threads=threads_for(slot, self.slots, os.cpu_count()),
            model_roots=self.settings.effective_model_roots,
            data_roots=self.settings.effective_data_roots,
            cache_dir=self.settings.storage_dir / "cache",
            host_memory_limit=self.settings.host_memory_share(len(self.slots)),
        )

    def _forward_stop(self, run: Running) -> None:
        try:
            wanted = self.store.get_job(run.job_id).stop_request
        except JobNotFound:
            wanted = "cancel"
        if wanted and wanted != run.stop_sent and run.stop_sent != "cancel":
            run.handle.request_stop(wanted)  # type: ignore[arg-type]
            run.stop_sent = wanted
            if wanted == "cancel":
                run.kill_at = time.monotonic() + self.settings.cancel_grace_s
        if run.kill_at is not None and time.monotonic() >= run.kill_at:
            run.handle.kill()  # cancel must be prompt even in the middle of a long step

    # -- deciding what an ended process means ----------------------------------------------------------

    def _compact(self, run: Running, every_s: float = 2.0) -> None:
        if time.monotonic() - run.compacted_at < every_s:
            return
        run.compacted_at = time.monotonic()
        try:
            run.compacted_id = self.store.compact_steps(run.job_id, run.compacted_id, self.retention)
        except sqlite3.Error:
            log.exception("could not compact the step events of %s", run.job_id)

    def _settle(self, run: Running, code: int) -> None:
        try:
            self._write_outcome(run, code)
        except sqlite3.Error:  # e.g. the disk is full: keep trying, so the job does not stay `running`
            log.exception("could not record how %s ended; retrying", run.job_id)
            self.unsettled.append((run, code))

    def _write_outcome(self, run: Running, code: int) -> None:
        try:
            job = self.store.get_job(run.job_id)
        except JobNotFound:
            return
        if job.status is not JobStatus.RUNNING or job.attempt != run.attempt:
            return
        outcome = self.store.last_outcome(job.id, run.attempt)
        target, reason, error = self._judge(job, run, code, outcome)
        try:
            self.store.transition(job.id, target, reason=reason, **error)
        except IllegalTransition:
            log.exception("could not settle %s", job.id)
            return
        if target is JobStatus.INTERRUPTED:
            self.store.requeue_interrupted(
                job.id, max_retries=self.settings.max_retries, count_retry=not run.shutting_down
            )
        run.compacted_at = 0.0
        self._compact(run)
        log.info("%s attempt %d ended: %s (%s)", job.id, run.attempt, target.value, reason)

    @staticmethod
    def _judge(
        job: JobRecord, run: Running, code: int, outcome: FinishedEvent | FailedEvent | None
    ) -> tuple[JobStatus, str, dict]:
        if isinstance(outcome, FailedEvent) and outcome.error is ErrorCode.INTERRUPTED:  # a lost rank: resume
            return JobStatus.INTERRUPTED, outcome.message, {}
        if isinstance(outcome, FailedEvent):
            return (
                JobStatus.FAILED,
                "the job raised an error",
                {"error_code": outcome.error, "error_message": outcome.message},
            )
        if isinstance(outcome, FinishedEvent) and outcome.status in ("succeeded", "cancelled"):
            return JobStatus(outcome.status), f"the job {outcome.status}", {}
        if isinstance(outcome, FinishedEvent) and outcome.status == "paused":
            if run.shutting_down:
                return JobStatus.INTERRUPTED, "paused for a server shutdown", {}
            return JobStatus.PAUSED, "checkpointed and paused", {}
        if job.stop_request == "cancel" or run.stop_sent == "cancel":
            return JobStatus.CANCELLED, "cancelled by user", {}
        if reason := run.handle.exit_reason():  # e.g. its Ray node was lost
            return JobStatus.INTERRUPTED, f"the job ended without finishing: {reason}", {}
        how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return JobStatus.INTERRUPTED, f"the job's process {how} without finishing", {}

    # -- start-up and shutdown ---------------------------------------------------------------------------

    def recover(self) -> None:
        """Jobs marked running by an earlier server are interrupted and requeued (bounded retries)."""
        for job in self.store.jobs_with_status(JobStatus.RUNNING):
            # Its process may outlive the dead server; it must be gone before anyone else writes that output.
            self.executor.stop_orphan(job.pid, job.pid_started_at, grace_s=self.settings.shutdown_grace_s)
            # A cancel or pause was committed before its process was signalled: it outlives the crash.
            if job.stop_request in _HONOURED:
                target, word = _HONOURED[job.stop_request]
                reason = f"{word} by user (the server restarted before the job's process stopped)"
                self.store.transition(job.id, target, reason=reason)
                continue
            self.store.transition(
                job.id,
                JobStatus.INTERRUPTED,
                reason=f"the server restarted and the job's process (pid {job.pid}) was gone",
            )
        for job in self.store.jobs_with_status(JobStatus.INTERRUPTED):
            self.store.requeue_interrupted(job.id, max_retries=self.settings.max_retries, count_retry=True)

    def _shutdown_running(self) -> None:
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        for run in self.running.values():
            run.shutting_down = True
            if run.stop_sent != "cancel":
                run.handle.request_stop("pause")
        while self.running and time.monotonic() < deadline:
            for run in self.running.values():
                if run.kill_at is not None and time.monotonic() >= run.kill_at:
                    run.handle.kill()  # a cancel stays prompt during shutdown too
            self._collect_ended()
            time.sleep(0.05)
        for run in self.running.values():
            run.handle.kill()
        while self.running:
            self._collect_ended()
            time.sleep(0.01)

    def _collect_ended(self) -> None:
        """Settle every run whose process has ended, freeing its slot."""
        for slot_id, run in list(self.running.items()):
            code = run.handle.exit_code()
            if code is not None and slot_id in self.running:  # not settled under another of its slots
                held = [s for s, other in self.running.items() if other is run]
                for s in held:
                    del self.running[s]
                self.placement.freed(held)
                self._settle(run, code)
