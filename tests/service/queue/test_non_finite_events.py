"""A diverged job (NaN or infinite loss) keeps every answer and the step-event retention working: its events are
stored as strict JSON (service/queue/stored_json.py), the OpenAI checkpoints list answers 200 with a null loss,
and the retention still compacts the job's steps, keeping the step where it diverged."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from jobs.checkpoints.directory import save_checkpoint
from jobs.events import StepEvent, event_to_wire
from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.queue.fine_tuning import FineTuningRecord, FineTuningStore
from service.queue.retention import StepRetention
from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.settings import Settings
from tests.service.checking.test_one_parse import IdleExecutor

JOB = "job-diverged"
RETENTION = StepRetention(keep_first=2, window=5)


def step(number: int, loss: float) -> dict:
    """A step event's wire form, as the job's process sends it (EventReporter)."""
    event = StepEvent(step=number, total_steps=40, loss=loss, lr=1e-4, samples_per_s=2.0, elapsed_s=1.0, eta_s=1.0)
    return event_to_wire(event)


def loss_at(number: int) -> float:
    """Finite losses with a NaN at 3, +inf at 9, -inf at 14 and NaN from step 20 on (windows 3-7, 8-12, ...)."""
    if number >= 20:
        return float("nan")
    return {3: float("nan"), 9: float("inf"), 14: float("-inf")}.get(number, 1.0 / number)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings


def diverged_job(settings: Settings) -> JobStore:
    store = JobStore(settings.db_path)
    store.create_job(job_id=JOB, name=None, spec_text="name: x", spec={})
    store.transition(JOB, JobStatus.RUNNING, reason="started")
    FineTuningStore(store.db).add(
        FineTuningRecord(JOB, "llama", "file-1", None, None, 1, {"type": "supervised"}, None, 0.0)
    )
    store.append_events(JOB, 1, [step(n, loss_at(n)) for n in range(1, 41)])
    return store


def steps_left(store: JobStore) -> list[int]:
    return [e.data["step"] for e in store.list_events(JOB, types=["step"], limit=1000)]


def test_a_nan_loss_leaves_the_retention_working(settings: Settings) -> None:
    store = diverged_job(settings)
    # Old code: "malformed JSON" here on every call, so the job's steps were never compacted.
    mark = store.compact_steps(JOB, 0, RETENTION)
    assert mark > 0
    left = steps_left(store)
    assert len(left) < 40
    assert {1, 2, 3, 9, 14} <= set(left)  # the first steps whole, the divergence (NaN, +inf, -inf) kept
    assert [n for n in left if 23 <= n <= 27] == [23, 27]  # a window of NaN losses: its first and its last
    stored = store.db.conn.execute("SELECT data FROM events WHERE type = 'step'").fetchall()
    assert all(json.loads(r[0], parse_constant=pytest.fail) for r in stored)  # strict JSON only
    store.close()


def test_rows_an_older_server_stored_with_bare_nan_are_repaired_on_start(settings: Settings) -> None:
    store = diverged_job(settings)
    store.close()
    conn = sqlite3.connect(settings.db_path)  # as the old code wrote them: json.dumps, NaN as a bare token
    for row_id, data in conn.execute("SELECT id, data FROM events WHERE type = 'step'").fetchall():
        old = data.replace('"-Infinity"', "-Infinity").replace('"Infinity"', "Infinity").replace('"NaN"', "NaN")
        conn.execute("UPDATE events SET data = ? WHERE id = ?", (old, row_id))
    conn.execute("DELETE FROM meta WHERE key = 'strict_json'")
    conn.commit()
    with pytest.raises(sqlite3.OperationalError, match="malformed JSON"):
        conn.execute("SELECT json_extract(data, '$.loss') FROM events WHERE type = 'step'").fetchall()
    conn.close()
    store = JobStore(settings.db_path)
    assert store.compact_steps(JOB, 0, RETENTION) > 0
    store.close()


@pytest.fixture
def ferry(settings: Settings) -> Iterator[tuple[openai.OpenAI, TestClient]]:
    store = diverged_job(settings)
    store.transition(JOB, JobStatus.CANCELLED, reason="cancelled by user")
    store.close()
    output = settings.job_dir(JOB) / "output"
    for number in (3, 8):
        save_checkpoint(output, number, {}, lambda d: (d / "model.safetensors").write_bytes(b"w"))
    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield (
            openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0),
            client,
        )


def test_the_openai_checkpoints_list_of_a_diverged_job_answers(ferry: tuple[openai.OpenAI, TestClient]) -> None:
    client, http = ferry
    checkpoints = client.fine_tuning.jobs.checkpoints.list(JOB).data  # old code: 500 (malformed JSON)
    assert [c.step_number for c in checkpoints] == [8, 3]
    assert checkpoints[0].metrics.train_loss == pytest.approx(1 / 8)
    assert checkpoints[1].metrics.train_loss is None  # NaN: no number to show
    events = {e.data["step"]: e for e in client.fine_tuning.jobs.list_events(JOB, limit=100) if e.type == "metrics"}
    assert events[3].data["train_loss"] is None and events[9].data["loss"] is None and events[14].data["loss"] is None
    assert "training loss=not finite" in events[3].message
    for path in (f"/v1/jobs/{JOB}", f"/v1/jobs/{JOB}/events?limit=100", f"/v1/jobs/{JOB}/metrics"):
        assert http.get(path).status_code == 200, path
    metrics = {p["step"]: p["loss"] for p in http.get(f"/v1/jobs/{JOB}/metrics").json()["data"]}
    assert metrics[3] is None and metrics[4] == pytest.approx(0.25)
