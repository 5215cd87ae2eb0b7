"""A full disk, the listing's weight and the job's log, through the API."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.checking.checker import SpecChecker
from service.queue import disk
from service.settings import Settings
from service.workers.executor.local import LocalProcessExecutor
from tests.service.conftest import spec_yaml, submit, wait_for, wait_status

YAML = {"content-type": "application/yaml"}


@pytest.fixture
def app_client(tmp_path: Path, spec_checker: SpecChecker) -> TestClient:
    settings = Settings(data_dir=tmp_path / "data", devices="cpu", warm_start=False, _env_file=None)
    app = create_app(settings, executor=LocalProcessExecutor(warm=[]), spec_checker=spec_checker)
    with TestClient(app) as client:
        yield client


def test_a_full_disk_is_reported_new_work_is_507_and_cancel_still_works(
    app_client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = app_client.post("/v1/jobs", content=spec_yaml(name="before", steps=100_000), headers=YAML).json()
    monkeypatch.setattr(disk, "free_bytes", lambda path: 10 << 20)
    ready = app_client.get("/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "disk_low"
    assert "has 10.0 MiB free, under FERRY_MIN_FREE_DISK_BYTES (256.0 MiB)" in ready.json()["reason"]
    refused = app_client.post("/v1/jobs", content=spec_yaml(name="after"), headers=YAML)
    assert refused.status_code == 507 and refused.json()["error"]["code"] == "insufficient_storage"
    assert [j["name"] for j in app_client.get("/v1/jobs").json()["data"]] == ["before"]  # nothing stored
    assert app_client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200


def test_cancel_and_delete_give_back_the_reserve_when_the_disk_is_full(
    app_client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = app_client.app.state.store
    reserve = app_client.app.state.settings.data_dir / disk.RESERVE_NAME
    assert reserve.stat().st_size == disk.RESERVE_BYTES
    job = app_client.post("/v1/jobs", content=spec_yaml(name="full", steps=100_000), headers=YAML).json()
    real, calls = store.cancel, []

    def full_until_space_is_freed(job_id: str) -> Any:
        calls.append(job_id)
        if reserve.exists():
            raise sqlite3.OperationalError("database or disk is full")
        return real(job_id)

    monkeypatch.setattr(store, "cancel", full_until_space_is_freed)
    assert app_client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    assert len(calls) == 2 and not reserve.exists()


def test_the_list_omits_specs_unless_asked(client: httpx.Client) -> None:
    job = submit(client, spec_yaml(name="listed", steps=1))
    listed = client.get("/v1/jobs").json()["data"]
    assert listed and all(j["spec"] is None and j["spec_text"] is None for j in listed)
    full = client.get("/v1/jobs", params={"include_spec": "true"}).json()["data"]
    assert next(j for j in full if j["id"] == job["id"])["spec_text"] == spec_yaml(name="listed", steps=1)
    assert client.get(f"/v1/jobs/{job['id']}").json()["spec"]["name"] == "listed"  # one job: always


def test_the_job_log_holds_steps_checkpoints_and_the_outcome(client: httpx.Client) -> None:
    job = submit(client, spec_yaml(name="logged", steps=3, every=3))
    wait_status(client, job["id"], "succeeded")
    log = client.get(f"/v1/jobs/{job['id']}/logs").text
    assert "step 1/3 loss " in log
    assert "checkpoint step-00000003 at step 3 written to " in log
    assert f"job {job['id']} finished: succeeded at step 3" in log


def test_the_job_page_history_leaves_the_steps_out(client: httpx.Client) -> None:
    job = submit(client, spec_yaml(name="history", steps=3, every=3))
    wait_status(client, job["id"], "succeeded")
    every = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    history = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000, "exclude": "step"}).json()["data"]
    assert [e for e in every if e["type"] != "step"] == history and "step" in {e["type"] for e in every}


def test_metrics_for_prometheus(client: httpx.Client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    job = submit(client, spec_yaml(name="scraped", steps=100_000, every=100_000))
    wait_for(client, job["id"], lambda j: j["progress"] is not None and j["progress"]["step"] > 0)
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert {s.labels["status"] for s in families["ferry_jobs"].samples} >= {"queued", "running", "succeeded"}
    steps = {s.labels["job_id"]: s.value for s in families["ferry_job_step"].samples}
    assert steps[job["id"]] > 0
    client.post(f"/v1/jobs/{job['id']}/cancel")
