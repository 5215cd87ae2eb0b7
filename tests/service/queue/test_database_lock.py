"""A database lock held past the busy timeout (another connection in BEGIN EXCLUSIVE: a backup, an sqlite3 shell)
never answers 500 and never fails a running job: a submit retries with backoff, then answers 503 with
Retry-After and stores nothing; a job's event writes keep their events and write them once the lock is gone."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import service.queue.db as db
import service.workers.executor.child as child
from jobs.events import StepEvent
from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.settings import Settings
from service.workers.executor.base import LaunchRequest
from tests.service.checking.test_one_parse import IdleExecutor

SPEC = "name: locked\nmodel: {kind: toy_mlp, hidden_size: 8, num_layers: 1}\ndata: {kind: synthetic_regression}\ntraining: {steps: 3}\n"
BUSY_S = 0.02  # the busy timeout of the test's connections: each try gives up quickly


class Lock:
    """Another connection holding ``BEGIN EXCLUSIVE`` on the file from a thread, until released (at most 30 s)."""

    def __init__(self, path: Path) -> None:
        self.path, self.taken, self.release = path, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        self.taken.set()
        self.release.wait(timeout=30)  # bounded: a failing test never hangs
        conn.execute("ROLLBACK")
        conn.close()

    def __enter__(self) -> Lock:
        self.thread.start()
        assert self.taken.wait(timeout=10)
        return self

    def __exit__(self, *_: Any) -> None:
        self.release.set()
        self.thread.join(timeout=10)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, devices="cpu", _env_file=None, db_busy_timeout_s=BUSY_S)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_a_submit_under_a_lock_answers_503_with_retry_after(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[float] = []
    real_sleep = db.sleep
    monkeypatch.setattr(db, "sleep", lambda seconds: tries.append(seconds) or real_sleep(seconds))
    with Lock(settings.db_path):
        answer = client.post("/v1/jobs", content=SPEC, headers={"Content-Type": "application/yaml"})
        openai = client.post("/v1/fine_tuning/jobs", json={"model": "m", "training_file": "file-0a"})
    monkeypatch.undo()
    assert answer.status_code == 503, answer.text  # old code: 500 (sqlite3.OperationalError)
    assert answer.headers["Retry-After"].isdigit()
    assert answer.json()["error"]["code"] == "database_busy"
    assert "send the request again" in answer.json()["error"]["message"]
    assert len(tries) >= 2 and tries == sorted(tries) and tries[-1] > tries[0]  # retried, with a growing wait
    assert client.get("/v1/jobs").json()["data"] == []  # nothing half-stored
    assert openai.status_code in (400, 503)  # its upload check reads only; never a 500


def test_a_lock_released_between_tries_lets_the_submit_through(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = Lock(settings.db_path)
    monkeypatch.setattr(db, "sleep", lambda _: lock.release.set() or lock.thread.join(timeout=10))
    with lock:
        answer = client.post("/v1/jobs", content=SPEC, headers={"Content-Type": "application/yaml"})
    assert answer.status_code == 201, answer.text  # the backoff's retry found the lock gone


def request(tmp_path: Path) -> LaunchRequest:
    return LaunchRequest(
        job_id="job-run", attempt=1, spec_text="", output_dir=tmp_path / "out", device=None,
        db_path=tmp_path / "ferry.sqlite3", log_path=tmp_path / "job.log",
    )  # fmt: skip


def step(number: int) -> StepEvent:
    return StepEvent(step=number, total_steps=9, loss=1.0, lr=1e-4, samples_per_s=1.0, elapsed_s=1.0, eta_s=1.0)


def test_a_running_jobs_events_wait_out_a_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = JobStore(tmp_path / "ferry.sqlite3", busy_timeout_s=BUSY_S)
    store.create_job(job_id="job-run", name=None, spec_text="name: x", spec={})
    store.transition("job-run", JobStatus.RUNNING, reason="started")
    reporter = child.EventReporter(store, request(tmp_path))
    reporter(step(1))
    lock = Lock(store.db.path)
    with lock:
        reporter(step(2))  # old code: sqlite3.OperationalError, and the job failed
        reporter.BATCH_S = 0.0
        reporter(step(3))  # still locked: kept
        # The outcome waits for the lock (backoff); here the lock goes while it waits.
        monkeypatch.setattr(child, "sleep", lambda _: lock.release.set() or lock.thread.join(timeout=10))
        reporter.finished("succeeded", 3)
    kinds = [(e.type, e.data.get("step")) for e in store.list_events("job-run") if e.type != "status"]
    assert kinds == [("step", 1), ("step", 2), ("step", 3), ("finished", 3)]
    store.close()
