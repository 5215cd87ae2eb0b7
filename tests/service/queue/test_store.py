"""The job store and its state machine, on a real SQLite file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from service.queue.status import ALLOWED, IllegalTransition, JobStatus
from service.queue.store import IdempotencyConflict, JobNotFound, JobStore, QueueFull


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    store = JobStore(tmp_path / "fresh" / "dir" / "ferry.sqlite3")  # the directory does not exist yet
    yield store
    store.close()


def add(store: JobStore, job_id: str = "job-1", **kw) -> str:
    store.create_job(job_id=job_id, name="n", spec_text="name: n\n", spec={"name": "n"}, **kw)
    return job_id


def force(store: JobStore, job_id: str, status: JobStatus) -> None:
    """Put a job into ``status`` through legal transitions only."""
    paths = {
        JobStatus.QUEUED: [],
        JobStatus.RUNNING: [JobStatus.RUNNING],
        JobStatus.PAUSED: [JobStatus.PAUSED],
        JobStatus.CANCELLED: [JobStatus.CANCELLED],
        JobStatus.SUCCEEDED: [JobStatus.RUNNING, JobStatus.SUCCEEDED],
        JobStatus.FAILED: [JobStatus.RUNNING, JobStatus.FAILED],
        JobStatus.INTERRUPTED: [JobStatus.RUNNING, JobStatus.INTERRUPTED],
    }
    for step in paths[status]:
        store.transition(job_id, step, reason="test")


def test_schema_is_created_on_a_fresh_data_dir_and_in_wal_mode(store: JobStore) -> None:
    assert store.db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.count_by_status()[JobStatus.QUEUED] == 0


@pytest.mark.parametrize("current", list(JobStatus))
@pytest.mark.parametrize("target", list(JobStatus))
def test_transition_follows_the_table_exactly(store: JobStore, current: JobStatus, target: JobStatus) -> None:
    force(store, add(store), current)
    if target in ALLOWED[current]:
        assert store.transition("job-1", target, reason="test").status is target
    else:
        with pytest.raises(IllegalTransition):
            store.transition("job-1", target, reason="test")
        assert store.get_job("job-1").status is current  # nothing changed


def test_illegal_transition_says_why(store: JobStore) -> None:
    force(store, add(store), JobStatus.SUCCEEDED)
    with pytest.raises(IllegalTransition) as error:
        store.cancel("job-1")
    assert str(error.value) == (
        "Job job-1 is succeeded and cannot be cancelled; only a queued, running, paused "
        "or interrupted job can be cancelled."
    )


def test_every_transition_is_recorded_as_an_event_in_order(store: JobStore) -> None:
    force(store, add(store), JobStatus.SUCCEEDED)
    statuses = [e.data["status"] for e in store.list_events("job-1") if e.type == "status"]
    assert statuses == ["queued", "running", "succeeded"]


def test_claim_takes_the_oldest_queued_job_and_counts_attempts(store: JobStore) -> None:
    add(store, "job-a"), add(store, "job-b")
    job = store.claim_next(worker="cpu0", device=None)
    assert (job.id, job.status, job.attempt, job.worker) == ("job-a", JobStatus.RUNNING, 1, "cpu0")
    assert store.claim_next(worker="cpu1", device=None).id == "job-b"
    assert store.claim_next(worker="cpu2", device=None) is None


def test_pause_and_cancel_of_a_running_job_are_requests_until_its_process_stops(store: JobStore) -> None:
    force(store, add(store), JobStatus.RUNNING)
    assert store.pause("job-1").stop_request == "pause"
    assert store.cancel("job-1").stop_request == "cancel"
    assert store.pause("job-1").stop_request == "cancel"  # never downgraded
    assert store.get_job("job-1").status is JobStatus.RUNNING


def test_interrupted_jobs_are_requeued_a_bounded_number_of_times(store: JobStore) -> None:
    add(store)
    for _ in range(2):
        force(store, "job-1", JobStatus.INTERRUPTED)
        assert store.requeue_interrupted("job-1", max_retries=2).status is JobStatus.QUEUED
    force(store, "job-1", JobStatus.INTERRUPTED)
    job = store.requeue_interrupted("job-1", max_retries=2)
    assert (job.status, job.error_code) == (JobStatus.FAILED, "interrupted")


def test_delete_only_finished_jobs(store: JobStore) -> None:
    force(store, add(store), JobStatus.RUNNING)
    with pytest.raises(IllegalTransition, match="cannot be deleted"):
        store.delete_job("job-1")
    store.transition("job-1", JobStatus.CANCELLED, reason="test")
    store.delete_job("job-1")
    with pytest.raises(JobNotFound):
        store.get_job("job-1")
    assert store.list_events("job-1") == []


def test_queue_limit_and_idempotency_keys(store: JobStore) -> None:
    add(store, "job-1", idempotency_key="k", request_sha256="a", max_queued=2)
    job, created = store.create_job(
        job_id="job-2", name="n", spec_text="", spec={}, idempotency_key="k", request_sha256="a", max_queued=2
    )
    assert (job.id, created) == ("job-1", False)
    with pytest.raises(IdempotencyConflict):
        add(store, "job-3", idempotency_key="k", request_sha256="b")
    add(store, "job-4", max_queued=2)
    with pytest.raises(QueueFull):
        add(store, "job-5", max_queued=2)
    assert [j.id for j in store.list_jobs()[0]] == ["job-4", "job-1"]


def test_list_jobs_pages_with_a_cursor_and_filters_by_status(store: JobStore) -> None:
    for n in range(5):
        add(store, f"job-{n}")
    force(store, "job-0", JobStatus.CANCELLED)
    first, cursor = store.list_jobs(limit=2)
    second, cursor2 = store.list_jobs(limit=2, before=cursor)
    third, end = store.list_jobs(limit=2, before=cursor2)
    assert [j.id for j in first + second + third] == ["job-4", "job-3", "job-2", "job-1", "job-0"]
    assert end is None
    assert [j.id for j in store.list_jobs(statuses=[JobStatus.CANCELLED])[0]] == ["job-0"]


def test_only_the_store_writes_status(store: JobStore) -> None:
    """A second connection sees each change committed: one transaction per change."""
    force(store, add(store), JobStatus.RUNNING)
    other = sqlite3.connect(store.db.path)
    assert other.execute("SELECT status, attempt FROM jobs").fetchone() == ("running", 1)
    other.close()


def test_an_undeclared_event_is_refused_and_not_stored(store: JobStore) -> None:
    from pydantic import ValidationError

    add(store)
    before = store.list_events("job-1")
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        store.append_event("job-1", 1, {"type": "progress", "step": 1})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        store.append_event("job-1", 1, {"type": "finished", "status": "succeeded", "step": 1, "extra": 1})
    assert store.list_events("job-1") == before


def test_an_undeclared_error_code_is_refused(store: JobStore) -> None:
    force(store, add(store), JobStatus.RUNNING)
    with pytest.raises(ValueError, match="'OutOfMemoryHint' is not a valid ErrorCode"):
        store.transition("job-1", JobStatus.FAILED, reason="x", error_code="OutOfMemoryHint", error_message="m")
    assert store.get_job("job-1").status is JobStatus.RUNNING
    store.transition("job-1", JobStatus.FAILED, reason="x", error_code="out_of_memory", error_message="m")
    assert store.get_job("job-1").error_code == "out_of_memory"


@pytest.mark.parametrize("status", list(JobStatus))
def test_allowed_actions_are_exactly_what_the_store_accepts(tmp_path: Path, status: JobStatus) -> None:
    from service.queue.status import JobAction, allowed_actions

    accepted = []
    for action in JobAction:
        store = JobStore(tmp_path / f"{action.value}.sqlite3")
        force(store, add(store), status)
        try:
            getattr(store, {"delete": "delete_job"}.get(action.value, action.value))("job-1")
            accepted.append(action)
        except IllegalTransition:
            pass
        store.close()
    assert allowed_actions(status) == accepted


def test_a_pending_stop_request_leaves_only_what_still_changes_the_job(store: JobStore) -> None:
    from service.api.schemas import JobPublic

    force(store, add(store), JobStatus.RUNNING)
    assert JobPublic.from_record(store.get_job("job-1")).allowed_actions == ["pause", "cancel"]
    store.pause("job-1")
    assert JobPublic.from_record(store.get_job("job-1")).allowed_actions == ["cancel"]
    store.cancel("job-1")
    assert JobPublic.from_record(store.get_job("job-1")).allowed_actions == []
