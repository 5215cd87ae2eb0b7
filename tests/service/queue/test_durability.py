"""What the store and scheduler keep through crashes, full disks and long jobs: a cancel survives a crash,
a resume by hand resets the retries, every job that lost its process leaves `running`, stored text always
serves, step events are few per step, and the metrics series holds one point per step."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from service.api.routes.events import read_metrics
from service.api.schemas import JobPublic
from service.queue.retention import StepRetention
from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.workers.devices import Slot
from service.workers.executor.base import LaunchRequest
from service.workers.executor.child import EventReporter
from tests.service.workers.test_scheduler import add, make


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    store = JobStore(tmp_path / "ferry.sqlite3")
    yield store
    store.close()


def step(n: int, loss: float = 1.0) -> dict[str, Any]:
    return {"type": "step", "step": n, "total_steps": 10**6, "elapsed_s": n, "eta_s": 1.0, "loss": loss, "lr": 0.1,
            "samples_per_s": 1.0}  # fmt: skip


def started(resumed_from: int | None) -> dict[str, Any]:
    device = {"type": "cpu", "name": "cpu", "visible_devices": None, "uuid": None}
    return {"type": "started", "total_steps": 10**6, "resumed_from_step": resumed_from, "spec": {}, "device": device}


@pytest.mark.parametrize(("request_", "status"), [("cancel", JobStatus.CANCELLED), ("pause", JobStatus.PAUSED)])
def test_a_stop_committed_before_a_crash_is_honoured_by_recovery(
    store: JobStore, tmp_path: Path, request_: str, status: JobStatus
) -> None:
    scheduler, _ = make(store, tmp_path, [Slot("cpu0", None)])
    add(store, "a")
    scheduler.tick()
    getattr(store, request_)("a")  # committed; the server dies before its process is signalled
    assert store.get_job("a").stop_request == request_
    restarted, executor = make(store, tmp_path, [Slot("cpu0", None)])
    restarted.recover()
    restarted.tick()
    assert store.get_job("a").status is status and executor.launched == []  # not run again


def test_a_resume_by_hand_resets_the_retries(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, [Slot("cpu0", None)], max_retries=1)
    add(store, "a")
    scheduler.tick()
    executor.launched[-1].code = -9  # crash 1: requeued, retries 1
    scheduler.tick()
    executor.launched[-1].code = -9  # crash 2: over the limit, failed
    scheduler.tick()
    assert (store.get_job("a").status, store.get_job("a").retries) == (JobStatus.FAILED, 1)
    assert store.resume("a").retries == 0
    scheduler.tick()
    executor.launched[-1].code = -9  # the next crash is retried again, not failed at once
    scheduler.tick()
    assert store.get_job("a").status is JobStatus.RUNNING


def test_no_job_stays_running_when_its_end_cannot_be_written_at_first(
    store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, executor = make(store, tmp_path, [Slot("cpu0", None)])
    add(store, "a")
    scheduler.tick()
    real, calls = store.transition, []

    def full_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "transition", full_once)
    store.append_event("a", 1, {"type": "finished", "status": "cancelled", "step": 3})
    executor.launched[0].code = 0
    scheduler.tick()  # the write fails: kept for the next tick
    assert store.get_job("a").status is JobStatus.RUNNING and scheduler.unsettled
    scheduler.tick()
    assert store.get_job("a").status is JobStatus.CANCELLED and not scheduler.unsettled


def test_stored_text_always_serves(store: JobStore) -> None:
    add(store, "a")
    store.claim_next(worker="cpu0", device=None)
    store.append_event("a", 1, {"type": "failed", "error": "training_error", "message": "cannot read /d/\udcff.txt"})
    store.transition("a", JobStatus.FAILED, reason="x", error_code="training_error", error_message="bad \udcff name")
    job = store.get_job("a")
    assert JobPublic.from_record(job).model_dump_json()  # encodable: a surrogate is stored as '?'
    assert job.error_message == "bad ? name"
    assert [e.data["message"] for e in store.list_events("a") if e.type == "failed"] == ["cannot read /d/?.txt"]


def test_step_retention_keeps_the_start_then_last_min_and_max_per_window(store: JobStore) -> None:
    add(store, "a")
    losses = {n: 1.0 for n in range(1, 1001)} | {437: 9.0, 455: 0.1, 911: 7.0}
    for first in range(1, 1001, 100):
        store.append_events("a", 1, [step(n, losses[n]) for n in range(first, first + 100)])
    mark = store.compact_steps("a", 0, StepRetention(keep_first=200, window=100))
    kept = [e.data["step"] for e in store.list_events("a", limit=10_000, types=["step"])]
    compacted = [n for n in kept if 200 < n <= 900]  # seven complete windows of 100 steps
    assert kept[:200] == list(range(1, 201))  # the start, whole
    assert set(compacted) >= {300, 400, 437, 455, 500, 900}  # each window's last, and its max and min loss
    assert len(compacted) <= 3 * 7
    # the newest window (901..1000) is still open: whole; compaction picks up from the mark
    assert [n for n in kept if n > 900] == list(range(901, 1001))
    store.append_events("a", 1, [step(1001)])
    store.compact_steps("a", mark, StepRetention(keep_first=200, window=100))
    assert [e.data["step"] for e in store.list_events("a", limit=10_000, types=["step"]) if e.data["step"] > 900] == [
        901,  # the lowest loss (the first of equals)
        911,  # the highest
        1000,  # the window's last
        1001,  # the next window, still open
    ]


def test_metrics_keep_the_latest_attempt_of_each_step(store: JobStore) -> None:
    add(store, "a")
    store.append_events("a", 1, [started(None), *[step(n, 1.0) for n in range(1, 8)]])
    store.append_events("a", 2, [started(4), *[step(n, 2.0) for n in range(5, 10)]])  # resumed from step 4
    points = read_metrics("a", store).data
    assert [(p.step, p.loss) for p in points] == [(n, 1.0) for n in range(1, 5)] + [(n, 2.0) for n in range(5, 10)]


class RecordingSink:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def append_events(self, job_id: str, attempt: int, events: list[dict[str, Any]]) -> None:
        self.batches.append([e["type"] for e in events])


def test_step_events_are_written_in_small_batches(tmp_path: Path) -> None:
    from jobs.events import CheckpointEvent, StepEvent

    sink = RecordingSink()
    request = LaunchRequest(job_id="a", attempt=1, spec_text="", output_dir=tmp_path, device=None,
                            db_path=tmp_path / "db", log_path=tmp_path / "job.log")  # fmt: skip
    reporter = EventReporter(sink, request)
    for n in range(1, 201):
        reporter(StepEvent(**{k: v for k, v in step(n).items() if k != "type"}))
    reporter(CheckpointEvent(step=200, name="step-200", path="x", files=[]))
    reporter.finished("succeeded", 200)
    assert sink.batches[0] == ["step"]  # the first step at once: the page shows progress without delay
    assert sum(len(b) for b in sink.batches) == 202 and len(sink.batches) <= 8
    assert sink.batches[-2][-1] == "checkpoint" and sink.batches[-1] == ["finished"]  # each at once, after its steps


def test_the_first_step_goes_out_at_once_even_right_after_started(tmp_path: Path) -> None:
    from jobs.events import StartedEvent, StepEvent

    sink = RecordingSink()
    request = LaunchRequest(job_id="a", attempt=1, spec_text="", output_dir=tmp_path, device=None,
                            db_path=tmp_path / "db", log_path=tmp_path / "job.log")  # fmt: skip
    reporter = EventReporter(sink, request)
    reporter(StartedEvent(**{k: v for k, v in started(None).items() if k != "type"}))
    for n in range(1, 4):  # well inside one batch interval of `started`
        reporter(StepEvent(**{k: v for k, v in step(n).items() if k != "type"}))
    # Waiting for the batch would hide the job's progress for BATCH_S (or BATCH_STEPS steps) after it starts.
    assert sink.batches == [["started"], ["step"]]
