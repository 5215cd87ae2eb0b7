"""The scheduler with a stand-in executor: slot assignment, ending states, cancel, recovery, shutdown."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.settings import Settings
from service.workers.devices import Slot
from service.workers.executor import LaunchRequest
from service.workers.scheduler import Scheduler


class FakeHandle:
    def __init__(self, request: LaunchRequest) -> None:
        self.request, self.pid, self.started_at = request, None, None
        self.code: int | None = None
        self.stops: list[str] = []

    def exit_code(self) -> int | None:
        return self.code

    def exit_reason(self) -> str | None:
        return None

    def request_stop(self, kind: str) -> None:
        self.stops.append(kind)

    def kill(self) -> None:
        self.code = -9


class FakeExecutor:
    """Launches nothing; the test decides when and how each 'process' ends."""

    def __init__(self) -> None:
        self.launched: list[FakeHandle] = []
        self.orphans_stopped: list[int | None] = []

    def launch(self, request: LaunchRequest) -> FakeHandle:
        self.launched.append(FakeHandle(request))
        return self.launched[-1]

    def keep_warm(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stop_orphan(self, pid: int | None, started_at: float | None, *, grace_s: float) -> None:
        self.orphans_stopped.append(pid)


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    store = JobStore(tmp_path / "ferry.sqlite3")
    yield store
    store.close()


def make(store: JobStore, tmp_path: Path, slots: list[Slot], **settings: object) -> tuple[Scheduler, FakeExecutor]:
    executor = FakeExecutor()
    config = Settings(data_dir=tmp_path, cancel_grace_s=0, shutdown_grace_s=0, _env_file=None, **settings)
    return Scheduler(store, executor, slots, config), executor


def add(store: JobStore, job_id: str, spec: dict[str, object] | None = None) -> str:
    store.create_job(job_id=job_id, name=job_id, spec_text="", spec=spec or {})
    return job_id


def end(store: JobStore, handle: FakeHandle, code: int, **event: object) -> None:
    if event:
        store.append_event(handle.request.job_id, handle.request.attempt, event)
    handle.code = code


def test_one_job_per_gpu_and_the_queue_feeds_the_first_free_one(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, [Slot("gpu0", "0"), Slot("gpu1", "1")])
    for name in ("a", "b", "c"):
        add(store, name)
    scheduler.tick()
    assert [(h.request.job_id, h.request.device) for h in executor.launched] == [("a", "0"), ("b", "1")]
    assert store.get_job("c").status is JobStatus.QUEUED

    end(store, executor.launched[1], 0, type="finished", status="succeeded", step=5)
    scheduler.tick()
    assert store.get_job("b").status is JobStatus.SUCCEEDED
    assert (executor.launched[2].request.job_id, executor.launched[2].request.device) == ("c", "1")
    assert store.get_job("c").worker == "gpu1"


def test_a_cpu_job_on_a_gpus_slot_records_no_gpu(store: JobStore, tmp_path: Path) -> None:
    scheduler, _ = make(store, tmp_path, [Slot("gpu0", "0"), Slot("gpu1", "1")])
    add(store, "cpu-job", {"device": "cpu"})
    add(store, "gpu-job", {"device": "cuda"})
    scheduler.tick()
    # Old code: device '0', which the jobs list showed in its GPU column for a job that trained on the CPU.
    assert (store.get_job("cpu-job").worker, store.get_job("cpu-job").device) == ("gpu0", None)
    assert (store.get_job("gpu-job").worker, store.get_job("gpu-job").device) == ("gpu1", "1")


def test_a_killed_process_is_interrupted_and_resumed_with_a_new_attempt(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, [Slot("cpu0", None)])
    add(store, "a")
    scheduler.tick()
    end(store, executor.launched[0], -9)
    scheduler.tick()
    job = store.get_job("a")
    assert (job.status, job.retries, job.attempt) == (JobStatus.RUNNING, 1, 2)
    reasons = [e.data["reason"] for e in store.list_events("a") if e.type == "status"]
    assert "the job's process was killed by signal SIGKILL without finishing" in reasons


def test_failed_and_paused_outcomes(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, [Slot("cpu0", None), Slot("cpu1", None)])
    add(store, "fails"), add(store, "pauses")
    scheduler.tick()
    end(store, executor.launched[0], 1, type="failed", error="out_of_memory", message="set offload.x: true")
    end(store, executor.launched[1], 0, type="finished", status="paused", step=3)
    scheduler.tick()
    failed = store.get_job("fails")
    assert (failed.status, failed.error_code, failed.error_message) == (
        JobStatus.FAILED,
        "out_of_memory",
        "set offload.x: true",
    )
    assert store.get_job("pauses").status is JobStatus.PAUSED


def test_cancel_is_forwarded_then_enforced(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, [Slot("cpu0", None)])
    add(store, "a")
    scheduler.tick()
    store.cancel("a")
    scheduler.tick()  # forwards the request; the grace (0 s here) has run out, so it kills
    assert executor.launched[0].stops == ["cancel"] and executor.launched[0].code == -9
    scheduler.tick()
    assert store.get_job("a").status is JobStatus.CANCELLED


def test_recovery_requeues_jobs_whose_process_is_gone(store: JobStore, tmp_path: Path) -> None:
    add(store, "a")
    store.claim_next(worker="cpu0", device=None)
    store.set_process("a", pid=999_999_999, started_at=1.0)  # no such process
    scheduler, executor = make(store, tmp_path, [Slot("cpu0", None)])
    scheduler.recover()
    job = store.get_job("a")
    assert (job.status, job.retries, executor.orphans_stopped) == (JobStatus.QUEUED, 1, [999_999_999])


def test_local_executor_leaves_a_reused_pid_alone() -> None:
    from service.workers.executor.local import same_process

    assert same_process(os.getpid(), 1.0) is None  # our pid, but not started at that time
    assert same_process(os.getpid(), psutil.Process().create_time()) is not None


def test_shutdown_pauses_running_jobs_back_into_the_queue_without_using_a_retry(
    store: JobStore, tmp_path: Path
) -> None:
    scheduler, executor = make(store, tmp_path, [Slot("cpu0", None)])
    add(store, "a")
    scheduler.tick()
    scheduler._stopping.set()
    handle = executor.launched[0]
    end(store, handle, 0, type="finished", status="paused", step=7)
    scheduler._shutdown_running()
    job = store.get_job("a")
    assert handle.stops == ["pause"] and (job.status, job.retries) == (JobStatus.QUEUED, 0)


def test_every_job_is_given_the_services_one_cache_directory(store: JobStore, tmp_path: Path) -> None:
    """What a later job with the same inputs reuses (DPO's reference log-probs) lives beside all jobs, not in one
    job's output directory, where no other job would find it."""
    scheduler, executor = make(store, tmp_path, [Slot("gpu0", "0"), Slot("gpu1", "1")])
    add(store, "a")
    add(store, "b")
    scheduler.tick()
    requests = [handle.request for handle in executor.launched]
    assert [r.cache_dir for r in requests] == [tmp_path / "cache", tmp_path / "cache"]
    assert requests[0].output_dir != requests[1].output_dir
