"""OpenAI's lists page on from a deleted item: ``after=`` a job or file deleted since the previous page, or a
checkpoint removed since, starts the next page at the item after it (ids are random, so the store keeps a
deleted row's place, ``db.deleted_ids``), as OpenAI does; it was a 404. Driven by OpenAI's client in process."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from jobs.checkpoints.directory import save_checkpoint
from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.queue.fine_tuning import FineTuningRecord, FineTuningStore
from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.settings import Settings
from tests.service.checking.test_one_parse import IdleExecutor

JOBS = [f"job-{n:012x}" for n in range(1, 6)]  # created in this order: listed newest first
METHOD = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 1}}}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore(settings.db_path)
    for job_id in JOBS:  # finished jobs (cancelled), so they can be deleted and nothing runs
        store.create_job(job_id=job_id, name=None, spec_text="name: x", spec={})
        store.transition(job_id, JobStatus.CANCELLED, reason="cancelled by user")
        FineTuningStore(store.db).add(FineTuningRecord(job_id, "llama", "file-1", None, None, 1, METHOD, None, 0.0))
    store.close()
    return settings


@pytest.fixture
def http(settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def ferry(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_after_a_deleted_job_pages_from_the_next_one(ferry: openai.OpenAI, http: TestClient) -> None:
    first = ferry.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in first.data] == [JOBS[4], JOBS[3]] and first.has_more
    assert http.delete(f"/v1/jobs/{JOBS[3]}").status_code == 204  # the page's last job, deleted meanwhile
    nxt = ferry.fine_tuning.jobs.list(after=JOBS[3], limit=2)  # old code: 404 "No job with id ..."
    assert [j.id for j in nxt.data] == [JOBS[2], JOBS[1]] and nxt.has_more
    assert [j.id for j in ferry.fine_tuning.jobs.list(after=JOBS[3], limit=2)] == JOBS[2::-1]  # the client pages on
    with pytest.raises(openai.NotFoundError):  # an id that never was is still refused
        ferry.fine_tuning.jobs.list(after="job-ffffffffffff")


def test_after_a_deleted_file_pages_from_the_next_one(ferry: openai.OpenAI) -> None:
    ids = [ferry.files.create(file=(f"{n}.txt", b"x"), purpose="user_data").id for n in range(4)]
    first = ferry.files.list(limit=2)
    assert [f.id for f in first.data] == [ids[3], ids[2]]
    ferry.files.delete(ids[2])
    nxt = ferry.files.list(after=ids[2], limit=2)  # old code: 404 "No file with id ..."
    assert [f.id for f in nxt.data] == [ids[1], ids[0]]
    with pytest.raises(openai.NotFoundError):
        ferry.files.list(after="file-0123456789abcdef")


def test_after_a_removed_checkpoint_pages_from_the_next_one(ferry: openai.OpenAI, settings: Settings) -> None:
    job = JOBS[0]
    output = settings.job_dir(job) / "output"
    for number in (2, 4, 6, 8):
        save_checkpoint(output, number, {}, lambda d: (d / "model.safetensors").write_bytes(b"w"))
    first = ferry.fine_tuning.jobs.checkpoints.list(job, limit=2)
    assert [c.step_number for c in first.data] == [8, 6] and first.has_more
    shutil.rmtree(output / "checkpoints" / "step-00000006")  # the page's last one, pruned meanwhile
    nxt = ferry.fine_tuning.jobs.checkpoints.list(job, after=first.data[-1].id, limit=2)  # old code: empty page
    assert [c.step_number for c in nxt.data] == [4, 2]
    with pytest.raises(openai.BadRequestError) as wrong:
        ferry.fine_tuning.jobs.checkpoints.list(job, after="ftckpt-other-3")
    assert wrong.value.body["param"] == "after"


def test_after_a_dropped_event_pages_from_the_next_one(ferry: openai.OpenAI, settings: Settings) -> None:
    job = JOBS[0]
    events = ferry.fine_tuning.jobs.list_events(job, limit=100).data
    assert len(events) >= 2
    store = JobStore(settings.db_path)
    store.db.conn.execute("DELETE FROM events WHERE id = ?", (int(events[0].id.removeprefix("ftevent-")),))
    store.close()
    assert [e.id for e in ferry.fine_tuning.jobs.list_events(job, after=events[0].id).data] == [
        e.id for e in events[1:]
    ]
