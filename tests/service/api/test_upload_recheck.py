"""Files an older server stored, before today's upload rules (or before rules versions were stored), on a database
that older server made: the database opens; a job naming such a file checks it again by today's rules at submit,
on the OpenAI route and on Ferry's YAML route, training and validation files; one that fails is refused naming
the file, its row and field, and nothing is stored; one that passes is read once, then trusted; and
``GET /v1/files/{id}`` says which."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.queue.db import create_schema
from service.uploads import recheck
from service.uploads.rows import RULES_VERSION
from tests.jobs.llm_helpers import chat_record
from tests.jobs.vlm_helpers import colour_record, data_url
from tests.service.api.openai_client import idle_ferry_client
from tests.service.api.test_openai_vision import TINY, as_url, image_bytes, save_vision_and_text_models

GIF_FIELD = "messages[0].content[0].image_url.url"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vision_and_text_models(tmp_path_factory.mktemp("models"))


def older_database(data_dir: Path) -> None:
    """The database as a server before rules versions made it: today's schema without the files' new columns."""
    create_schema(data_dir / "ferry.sqlite3")
    conn = sqlite3.connect(data_dir / "ferry.sqlite3")
    for column in ("rules_version", "rules_problem"):
        conn.execute(f"ALTER TABLE files DROP COLUMN {column}")
    conn.close()


def stored_by_an_older_server(data_dir: Path, file_id: str, rows: list[dict[str, Any]], format: str) -> None:
    """A fine-tuning upload as a server that predates today's rules kept it: its bytes, and a record whose
    layout that server found; no rules version (it stored none)."""
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (data_dir / "uploads" / file_id).mkdir(parents=True)
    (data_dir / "uploads" / file_id / "train.jsonl").write_bytes(body)
    conn = sqlite3.connect(data_dir / "ferry.sqlite3")
    conn.execute(
        "INSERT INTO files (id, filename, purpose, bytes, sha256, path, format, rows, created_at)"
        " VALUES (?, 'train.jsonl', 'fine-tune', ?, 'unused', ?, ?, ?, ?)",
        (file_id, len(body), f"{file_id}/train.jsonl", format, len(rows), time.time()),
    )
    conn.commit()
    conn.close()


def a_gif_row() -> dict[str, Any]:
    """Accepted at upload before OpenAI's format rule (JPEG, PNG, WEBP) was enforced; refused by it today."""
    return colour_record(as_url(image_bytes("P", "GIF"), "gif"), "red")


def good_rows() -> list[dict[str, Any]]:
    return [colour_record(data_url("red"), "red"), colour_record(data_url("blue"), "blue")]


OLD_BAD, OLD_GOOD, OLD_TEXT = "file-0bad", "file-00a0", "file-07e7"


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    older_database(tmp_path)
    stored_by_an_older_server(tmp_path, OLD_BAD, [*good_rows(), a_gif_row()], "image_chat")
    stored_by_an_older_server(tmp_path, OLD_GOOD, good_rows(), "image_chat")
    stored_by_an_older_server(tmp_path, OLD_TEXT, [chat_record(i) for i in range(4)], "chat")
    return tmp_path


@pytest.fixture
def ferry(data_dir: Path, models: Path) -> Iterator[openai.OpenAI]:
    with idle_ferry_client(data_dir, model_roots=[models]) as client:
        yield client


def raw(ferry: openai.OpenAI) -> httpx.Client:
    return ferry._client  # the in-process TestClient the openai client sends through


def stored_jobs(data_dir: Path) -> tuple[int, int]:
    conn = sqlite3.connect(data_dir / "ferry.sqlite3")
    counts = (
        conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0],
        conn.execute("SELECT COUNT(*) FROM fine_tuning_jobs").fetchone()[0],
    )
    conn.close()
    return counts


def test_an_older_database_opens_and_lists_its_files_as_not_yet_checked_by_todays_rules(ferry: openai.OpenAI) -> None:
    listed = {f.id: f for f in ferry.files.list().data}  # old code: the new columns' absence is no error...
    assert set(listed) == {OLD_BAD, OLD_GOOD, OLD_TEXT}
    assert {f.status for f in listed.values()} == {"uploaded"}  # ...and every old file said "processed"
    assert listed[OLD_BAD].rules_version is None  # type: ignore[attr-defined]
    assert "checked again when a job names it" in (listed[OLD_BAD].status_details or "")
    fresh = ferry.files.create(file=("new.jsonl", json.dumps(chat_record(0)).encode() + b"\n"), purpose="fine-tune")
    assert (fresh.status, fresh.rules_version) == ("processed", RULES_VERSION)  # type: ignore[attr-defined]
    assert ferry.files.retrieve(fresh.id).status == "processed"


def test_reading_an_old_file_checks_it_and_says_how_it_fails_todays_rules(ferry: openai.OpenAI) -> None:
    bad = ferry.files.retrieve(OLD_BAD)  # old code: status "processed", a file no job can train
    assert (bad.status, bad.rules_version) == ("error", RULES_VERSION)  # type: ignore[attr-defined]
    assert bad.status_details is not None and bad.status_details.startswith(
        f"fails the upload rules of version {RULES_VERSION}: row 3: field '{GIF_FIELD}': is image/gif;"
    )
    assert "upload the file again" in bad.status_details
    good = ferry.files.retrieve(OLD_GOOD)
    assert (good.status, good.status_details, good.rows) == ("processed", None, 2)
    listed = {f.id: f.status for f in ferry.files.list().data}
    assert listed == {OLD_BAD: "error", OLD_GOOD: "processed", OLD_TEXT: "uploaded"}


@pytest.mark.parametrize("param", ["training_file", "validation_file"])
def test_the_openai_route_refuses_an_old_file_that_fails_todays_rules_naming_file_row_and_field(
    ferry: openai.OpenAI, data_dir: Path, param: str
) -> None:
    files = {"training_file": OLD_GOOD, "validation_file": OLD_GOOD, param: OLD_BAD}
    with pytest.raises(openai.BadRequestError) as refused:  # old code: 200, the job queued
        ferry.fine_tuning.jobs.create(model="qwen", **files, extra_body={"ferry": TINY})
    error = refused.value.body
    assert error["param"] == param, error
    assert error["message"].startswith(
        f"{param}: file {OLD_BAD} (train.jsonl) was accepted at upload by older upload rules and fails today's "
        f"(version {RULES_VERSION}): row 3: field '{GIF_FIELD}': is image/gif; OpenAI's vision fine-tuning takes "
        "JPEG, PNG and WEBP images"
    ), error
    assert "Fix that row and upload the file again (POST /v1/files)" in error["message"]
    assert stored_jobs(data_dir) == (0, 0)  # nothing stored for the refused job
    with pytest.raises(openai.BadRequestError):  # and refused again, from the stored verdict
        ferry.fine_tuning.jobs.create(model="qwen", **files, extra_body={"ferry": TINY})
    assert stored_jobs(data_dir) == (0, 0)


def test_a_good_old_file_is_checked_once_then_trusted(
    ferry: openai.OpenAI, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Path] = []
    check = recheck.check_fine_tuning_rows
    monkeypatch.setattr(recheck, "check_fine_tuning_rows", lambda path, **kw: reads.append(path) or check(path, **kw))
    first = ferry.fine_tuning.jobs.create(
        model="qwen", training_file=OLD_GOOD, validation_file=OLD_GOOD, extra_body={"ferry": TINY}
    )
    assert first.id.startswith("job-") and len(reads) == 1  # one read of the file, for both of its uses
    assert ferry.files.retrieve(OLD_GOOD).rules_version == RULES_VERSION  # type: ignore[attr-defined]
    second = ferry.fine_tuning.jobs.create(model="qwen", training_file=OLD_GOOD, extra_body={"ferry": TINY})
    assert second.id != first.id and len(reads) == 1  # the stored version: not read again
    assert stored_jobs(data_dir) == (2, 2)


def test_an_old_file_whose_layout_changed_under_todays_rules_is_built_by_the_new_layout(
    data_dir: Path, models: Path
) -> None:
    """An older server stored an image file as plain ``chat`` (it had no image layout): checked again, it is an
    image file, so a text model refuses it naming the image row instead of training its text alone."""
    stored_by_an_older_server(data_dir, "file-0c4a", [chat_record(0), colour_record(data_url("red"), "red")], "chat")
    with idle_ferry_client(data_dir, model_roots=[models]) as ferry:
        with pytest.raises(openai.BadRequestError) as refused:
            ferry.fine_tuning.jobs.create(model="llama", training_file="file-0c4a", extra_body={"ferry": TINY})
        assert "row 2: field 'messages[0].content[0]' is an image" in refused.value.body["message"]
        assert ferry.files.retrieve("file-0c4a").format == "image_chat"  # type: ignore[attr-defined]


def yaml_job(training: str, validation: str | None = None) -> str:
    """A Ferry job on the uploads by id: the spec the OpenAI route builds for the vision base, written by hand."""
    return (
        "name: old-upload\ndevice: cpu\n"
        "model: {kind: hf_image_text_to_text, path: qwen, dtype: float32}\n"
        f"data: {{kind: image_chat, path: {training}, seq_len: 128}}\n"
        "lora: {rank: 4, target_modules: [q_proj, k_proj, v_proj, o_proj]}\n"
        "training: {epochs: 1, batch_size: 1, learning_rate: 0.0001}\n"
        + (f"eval: {{path: {validation}}}\n" if validation else "")
    )


def submit_yaml(client: httpx.Client, spec: str, route: str = "/v1/jobs") -> httpx.Response:
    return client.post(
        route,
        content=spec,
        headers={"content-type": "application/yaml"},
    )


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/jobs/validate"])
def test_the_yaml_route_refuses_an_old_file_that_fails_todays_rules_naming_the_field_file_and_row(
    ferry: openai.OpenAI, data_dir: Path, route: str
) -> None:
    answer = submit_yaml(raw(ferry), yaml_job(OLD_BAD), route)  # old code: 201 (or valid: true)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_file"
    assert error["message"].startswith(
        f"data.path: file {OLD_BAD} (train.jsonl) was accepted at upload by older upload rules and fails today's "
        f"(version {RULES_VERSION}): row 3: field '{GIF_FIELD}': is image/gif;"
    ), error
    assert error["problems"][0]["path"] == "data.path"
    assert stored_jobs(data_dir) == (0, 0)


def test_the_yaml_route_checks_an_old_validation_file_and_accepts_good_old_files(
    ferry: openai.OpenAI, data_dir: Path
) -> None:
    client = raw(ferry)
    refused = submit_yaml(client, yaml_job(OLD_GOOD, OLD_BAD))
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["problems"][0]["path"] == "eval.path"
    assert OLD_BAD in refused.json()["error"]["message"]
    accepted = submit_yaml(client, yaml_job(OLD_GOOD, OLD_GOOD))
    assert accepted.status_code == 201, accepted.text
    assert stored_jobs(data_dir) == (1, 0)
    versions = {f.id: f.rules_version for f in ferry.files.list().data}  # type: ignore[attr-defined]
    assert versions == {OLD_BAD: RULES_VERSION, OLD_GOOD: RULES_VERSION, OLD_TEXT: None}  # the one no job named


def test_an_old_file_whose_bytes_are_gone_is_refused_naming_it(ferry: openai.OpenAI, data_dir: Path) -> None:
    (data_dir / "uploads" / OLD_GOOD / "train.jsonl").unlink()
    with pytest.raises(openai.BadRequestError) as refused:
        ferry.fine_tuning.jobs.create(model="qwen", training_file=OLD_GOOD, extra_body={"ferry": TINY})
    assert (
        f"file {OLD_GOOD} (train.jsonl) is listed but its bytes are no longer on disk" in refused.value.body["message"]
    )
    assert ferry.files.retrieve(OLD_GOOD).status == "uploaded"  # not checked: nothing stored about it
    assert stored_jobs(data_dir) == (0, 0)


def test_a_job_queued_before_the_upgrade_is_checked_by_todays_rules_when_it_starts(data_dir: Path) -> None:
    """Jobs an older server queued name files only its rules checked: at start the scheduler reads each again by
    today's; the job naming the GIF fails naming its field, file, row and field, and never launches (the old code
    launched it onto the GIF), while the job naming a good old file starts."""
    from service.queue.files import FileStore
    from service.queue.status import JobStatus
    from service.queue.store import JobStore
    from service.settings import Settings
    from service.workers.devices import Slot
    from service.workers.scheduler import Scheduler
    from tests.service.workers.test_scheduler import FakeExecutor

    store = JobStore(data_dir / "ferry.sqlite3")  # today's store opens the older database (its migration)
    try:
        for job_id, file_id in (("job-bad", OLD_BAD), ("job-good", OLD_GOOD)):
            spec = {"data": {"format": "image_chat", "path": str((data_dir / "uploads" / file_id).resolve())}}
            store.create_job(job_id=job_id, name=job_id, spec_text="", spec=spec, uploads=[file_id])
        executor = FakeExecutor()
        settings = Settings(data_dir=data_dir, _env_file=None)
        Scheduler(store, executor, [Slot("cpu0", None), Slot("cpu1", None)], settings).tick()

        assert [handle.request.job_id for handle in executor.launched] == ["job-good"]
        bad = store.get_job("job-bad")
        assert bad.status is JobStatus.FAILED and bad.error_code == "invalid_spec", bad
        assert bad.error_message is not None
        for said in ("queued before", "data.path", OLD_BAD, "row 3", GIF_FIELD, "submit the job again"):
            assert said in bad.error_message, (said, bad.error_message)
        assert recheck.rules_problem(FileStore(store.db).get(OLD_BAD)) is not None  # the verdict is kept
    finally:
        store.close()
