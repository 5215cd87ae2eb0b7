"""What an operator does cannot break the service: a second server, a public bind without a token, a full
queue; and what it keeps is private to its owner."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

import service.__main__ as service_main
from service.api.app import create_app
from service.checking.checker import SpecChecker
from service.queue.data_dir import DataDirInUse, DataDirLock
from service.settings import Settings
from tests.service.conftest import TOKEN, Server, spec_yaml, submit, wait_status


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_second_server_on_the_data_directory_refuses_to_start_and_names_the_pid(make_server) -> None:  # type: ignore[no-untyped-def]
    first = make_server()
    with first.client() as client:
        job = submit(client, spec_yaml(name="long", steps=100_000, every=100_000))
        wait_status(client, job["id"], "running")
        second = subprocess.run(
            [sys.executable, "-m", "service"],
            env={**first.env, "FERRY_PORT": str(first.port + 1)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert second.stderr.strip() == (
            f"ferry: the data directory {first.data_dir.resolve()} is in use by another Ferry server "
            f"(pid {first.process.pid}); stop it first, or give this one its own FERRY_DATA_DIR"
        )
        time.sleep(0.5)
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"  # untouched
        client.post(f"/v1/jobs/{job['id']}/cancel")


def test_the_lock_in_the_app_itself(tmp_path: Path) -> None:
    held = DataDirLock.acquire(tmp_path)
    try:
        with pytest.raises(DataDirInUse, match=rf"in use by another Ferry server \(pid {os.getpid()}\)"):
            DataDirLock.acquire(tmp_path)
    finally:
        held.release()
    DataDirLock.acquire(tmp_path).release()  # released: free again


def test_data_directory_0700_files_0600_and_a_full_queue_says_when_to_retry(make_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = make_server(FERRY_MAX_QUEUED_JOBS="1")
    with server.client() as client:
        running = submit(client, spec_yaml(name="runs", steps=100_000, every=2))
        wait_status(client, running["id"], "running")
        queued = submit(client, spec_yaml(name="waits"))
        refused = client.post("/v1/jobs", content=spec_yaml(name="refused"), headers={"content-type": "text/yaml"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "10"
        assert refused.json()["error"]["code"] == "queue_full"
        deadline = time.monotonic() + 60
        while not client.get(f"/v1/jobs/{running['id']}/checkpoints").json()["data"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for job in (running, queued):
            client.post(f"/v1/jobs/{job['id']}/cancel")
        # Cancelling is asynchronous: until the job has stopped, a checkpoint it is writing (a temporary folder
        # renamed into place) can vanish under the walk below.
        for job in (running, queued):
            wait_status(client, job["id"], "cancelled")
    data = server.data_dir
    assert mode(data) == 0o700 and mode(data / "jobs") == 0o700
    assert mode(data / "ferry.sqlite3") == 0o600
    job_dir = data / "jobs" / running["id"]
    files = [p for p in job_dir.rglob("*") if p.is_file()]
    assert files and {mode(p) for p in files} == {0o600}, [(p, oct(mode(p))) for p in files]
    assert {mode(p) for p in job_dir.rglob("*") if p.is_dir()} == {0o700}


@pytest.mark.parametrize(
    ("token", "peer", "status"),
    [
        (None, "127.0.0.1", 200),
        (None, "::1", 200),
        (None, "::ffff:127.0.0.1", 200),
        (None, "10.1.2.3", 403),
        ("short", "10.1.2.3", 403),
        ("short", "127.0.0.1", 200),
        (TOKEN, "10.1.2.3", 200),
    ],
)
def test_without_a_long_token_only_loopback_peers_are_served(
    tmp_path: Path, token: str | None, peer: str, status: int
) -> None:
    app = create_app(Settings(data_dir=tmp_path, api_token=token, _env_file=None))  # whatever binds the socket
    response = TestClient(app, client=(peer, 50000)).get("/health")  # no lifespan: /health needs none
    assert response.status_code == status
    if status == 403:
        assert response.json()["error"]["code"] == "loopback_only"
        assert "answers only this machine (loopback)" in response.json()["error"]["message"]


def test_a_short_token_on_a_public_bind_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match="FERRY_API_TOKEN is shorter than 16 characters"):
        Settings(host="0.0.0.0", api_token="x", _env_file=None)


def test_gc_frozen_after_start_up(tmp_path: Path, spec_checker: SpecChecker) -> None:
    from service.workers.executor.local import LocalProcessExecutor

    settings = Settings(data_dir=tmp_path, devices="cpu", warm_start=False, _env_file=None)
    app = create_app(settings, executor=LocalProcessExecutor(warm=[]), spec_checker=spec_checker)
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200
        assert gc.get_freeze_count() > 10_000  # start-up's objects, out of the collector's walks
    assert gc.get_freeze_count() == 0


def test_access_log_off_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(service_main.uvicorn, "run", lambda app, **kwargs: calls.append(kwargs))
    monkeypatch.setenv("FERRY_DEVICES", "cpu")
    assert service_main.main(["--data-dir", str(tmp_path)]) == 0
    monkeypatch.setenv("FERRY_ACCESS_LOG", "true")
    assert service_main.main(["--data-dir", str(tmp_path)]) == 0
    assert [c["access_log"] for c in calls] == [False, True]


def test_health_of_a_server_bound_by_uvicorn_itself(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200  # loopback peer, token set: served
