"""A job's JSON answer is served again while its row is unchanged, and built anew the moment any value changes."""

from __future__ import annotations

import json
from pathlib import Path

from jobs.events import CheckpointEvent, StepEvent
from service.api.job_answers import JobAnswers
from service.api.schemas import JobPublic, JobsPublic
from service.queue.records import JobRecord
from service.queue.store import JobStore


def expected(store: JobStore, job_id: str, include_spec: bool = True) -> bytes:
    return JobPublic.from_record(store.get_job(job_id), include_spec=include_spec).model_dump_json().encode()


def step(n: int) -> StepEvent:
    return StepEvent(step=n, total_steps=10, loss=1.0 / n, lr=1e-3, samples_per_s=5.0, elapsed_s=n, eta_s=10 - n)


def test_the_answer_follows_every_change_of_the_row(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "ferry.sqlite3")
    store.create_job(job_id="job-1", name="one", spec_text="name: one\n", spec={"name": "one"})
    answers = JobAnswers()

    first = answers.json_of(store.get_job_row("job-1"), include_spec=True)
    assert first == expected(store, "job-1")
    assert answers.json_of(store.get_job_row("job-1"), include_spec=True) is first  # unchanged: not rebuilt

    changes = [
        lambda: store.claim_next(worker="cpu0", device=None),  # status, worker, started_at
        lambda: store.set_process("job-1", pid=1234, started_at=1.5),  # no updated_at bump
        lambda: store.append_events("job-1", 1, [step(1)]),  # progress only
        lambda: store.append_events("job-1", 1, [CheckpointEvent(step=1, path="/x/step-1", name="step-1", files=[])]),
        lambda: store.pause("job-1"),  # stop_request
    ]
    for change in changes:
        change()  # several of them leave updated_at as it was
        body = answers.json_of(store.get_job_row("job-1"), include_spec=True)
        assert body == expected(store, "job-1"), change
    assert json.loads(body)["stop_requested"] == "pause" and json.loads(body)["last_checkpoint"]["name"] == "step-1"


def test_a_page_is_the_list_models_json_and_spec_is_kept_apart(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "ferry.sqlite3")
    for n in range(3):
        store.create_job(job_id=f"job-{n}", name=f"n{n}", spec_text=f"name: n{n}\n", spec={"name": f"n{n}"})
    answers = JobAnswers(capacity=2)
    for include_spec in (False, True):
        rows, cursor = store.list_job_rows(limit=2)
        page = answers.page_json(rows, cursor, include_spec=include_spec)
        records = [JobRecord.from_row(r) for r in rows]
        model = JobsPublic(data=[JobPublic.from_record(r, include_spec=include_spec) for r in records], next_cursor="2")
        assert page == model.model_dump_json().encode()
    assert json.loads(page)["data"][0]["spec"] == {"name": "n2"}
    assert len(answers._kept) == 2  # the capacity holds
