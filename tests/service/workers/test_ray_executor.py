"""FERRY_EXECUTOR=ray on a local Ray instance started here (CPU only): jobs run as Ray actor tasks.

The test process is the Ray head; the server joins it as a second driver, as it would join a cluster's
head with FERRY_RAY_ADDRESS. Skipped where Ray is not installed (`pip install -e '.[dev,ray]'`).
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.service.api.test_api_jobs import SMOKE, all_events
from tests.service.conftest import REPO, TOKEN, Server, spec_yaml, submit, wait_for, wait_status

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A private Ray instance with two CPUs and no dashboard, torn down after the module."""
    # Ray's workers inherit this environment: they must import `service` and `jobs` as the server does.
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), old_path) if p)
    ray.init(
        num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024 * 1024
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


@pytest.fixture(scope="module")
def ray_server(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("ferry-ray")
    server = Server(
        root / "data",
        {
            "FERRY_API_TOKEN": TOKEN,
            "FERRY_EXECUTOR": "ray",
            "FERRY_RAY_ADDRESS": ray_address,
            "FERRY_SHARED_DIR": str(root / "shared"),
            "FERRY_RAY_MAX_JOBS": "1",
            "FERRY_RAY_CPUS_PER_JOB": "1",
            "FERRY_CANCEL_GRACE_S": "30",
        },
    )
    server.start(timeout=90)
    yield server
    server.stop()


@pytest.fixture
def client(ray_server: Server) -> Iterator[httpx.Client]:
    with ray_server.client() as c:
        yield c


def ray_worker_pid(client: httpx.Client, job_id: str) -> int:
    """The pid of the Ray worker running ``job_id``, once Ray has placed it."""

    def placed(_: dict) -> bool:
        workers = client.get("/v1/workers").json()["data"]
        return any(w["job_id"] == job_id and w["pid"] for w in workers)

    wait_for(client, job_id, placed, timeout=60)
    return next(w["pid"] for w in client.get("/v1/workers").json()["data"] if w["job_id"] == job_id)


def test_cpu_job_runs_on_ray_to_succeeded_with_events_and_checkpoints(ray_server: Server, client: httpx.Client) -> None:
    job = submit(client, SMOKE)
    done = wait_status(client, job["id"], "succeeded", "failed", "interrupted", timeout=120)
    assert done["status"] == "succeeded", done["error"]
    assert done["worker"] == "ray0" and done["progress"]["step"] == 30

    events = all_events(client, job["id"])
    assert [e["data"]["status"] for e in events if e["type"] == "status"] == ["queued", "running", "succeeded"]
    placed = next(e["data"]["message"] for e in events if e["type"] == "log")
    assert placed.startswith("attempt 1 runs on Ray node ")
    assert [e["data"]["step"] for e in events if e["type"] == "step"] == list(range(1, 31))
    assert [e["data"]["step"] for e in events if e["type"] == "checkpoint"] == [10, 20, 30]
    assert [e["type"] for e in events][-2:] == ["finished", "status"]
    series = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    assert [p["step"] for p in series] == list(range(1, 31))

    # Checkpoints and the log are on the shared path, and the service serves them as for a local job.
    assert (ray_server.data_dir.parent / "shared" / "jobs" / job["id"] / "output" / "checkpoints").is_dir()
    assert "(Ray)" in client.get(f"/v1/jobs/{job['id']}/logs").text
    checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
    assert [c["step"] for c in checkpoints] == [20, 30]
    for entry in checkpoints[-1]["files"]:
        download = client.get(entry["url"])
        assert download.status_code == 200
        assert hashlib.sha256(download.content).hexdigest() == entry["sha256"]


def test_cancel_reaches_the_ray_job(client: httpx.Client) -> None:
    job = submit(client, spec_yaml("ray-cancel", steps=100_000, every=1000))
    wait_for(client, job["id"], lambda j: j["progress"] is not None and j["progress"]["step"] >= 3, timeout=60)
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["stop_requested"] == "cancel"

    done = wait_status(client, job["id"], "cancelled", "failed", "succeeded", timeout=30)
    assert done["status"] == "cancelled"
    events = all_events(client, job["id"])
    # The job stopped itself between steps (the grace before a kill is 30 s): the request reached it.
    assert next(e["data"] for e in events if e["type"] == "finished")["status"] == "cancelled"
    assert events[-1]["data"]["reason"] == "the job cancelled"


def test_pause_reaches_the_ray_job_which_resumes_from_its_checkpoint(client: httpx.Client) -> None:
    job = submit(client, spec_yaml("ray-pause", steps=100_000, every=1000))
    wait_for(client, job["id"], lambda j: j["progress"] is not None and j["progress"]["step"] >= 3, timeout=60)
    assert client.post(f"/v1/jobs/{job['id']}/pause").status_code == 200
    paused = wait_status(client, job["id"], "paused", "failed", timeout=30)
    assert paused["status"] == "paused"
    saved = paused["last_checkpoint"]["step"]
    assert saved >= 3  # pause checkpoints at the step it stopped on, off the every_steps schedule

    assert client.post(f"/v1/jobs/{job['id']}/resume").status_code == 200
    wait_for(client, job["id"], lambda j: j["attempt"] == 2 and j["progress"]["step"] > saved, timeout=60)
    client.post(f"/v1/jobs/{job['id']}/cancel")
    assert wait_status(client, job["id"], "cancelled", "failed", timeout=30)["status"] == "cancelled"
    started = [e["data"]["resumed_from_step"] for e in all_events(client, job["id"]) if e["type"] == "started"]
    assert started == [None, saved]


def test_killed_ray_worker_interrupts_the_job_which_resumes_from_its_checkpoint(client: httpx.Client) -> None:
    job_id = submit(client, spec_yaml("ray-kill", steps=300, every=10))["id"]
    pid = ray_worker_pid(client, job_id)
    assert psutil.Process(pid).parent().pid != psutil.Process().pid  # Ray's worker, not a child of ours
    wait_for(client, job_id, lambda j: j["last_checkpoint"] is not None and j["progress"]["step"] >= 15, timeout=60)
    os.kill(pid, signal.SIGKILL)  # as when a node is lost: the job gets no chance to say anything

    job = wait_status(client, job_id, "succeeded", "failed", timeout=150)
    assert job["status"] == "succeeded", job["error"]
    assert job["retries"] == 1
    events = all_events(client, job_id)
    assert [e["data"]["status"] for e in events if e["type"] == "status"] == [
        "queued",
        "running",
        "interrupted",
        "queued",
        "running",
        "succeeded",
    ]
    interrupted = next(e for e in events if e["data"].get("status") == "interrupted")
    assert interrupted["data"]["reason"].startswith("the job ended without finishing: its Ray worker died")
    resumed_from = [e["data"]["resumed_from_step"] for e in events if e["type"] == "started"]
    saved_before_kill = [e["data"]["step"] for e in events if e["type"] == "checkpoint" and e["attempt"] == 1]
    assert resumed_from[0] is None and resumed_from[1] >= max(saved_before_kill) >= 10
    steps_after = [e["data"]["step"] for e in events if e["type"] == "step" and e["attempt"] == 2]
    assert steps_after == list(range(resumed_from[1] + 1, 301))  # no step redone from 0


def test_a_killed_server_takes_its_ray_jobs_down_and_the_next_server_resumes_them(
    ray_server: Server, tmp_path: Path
) -> None:
    env = {
        key: ray_server.env[key]
        for key in (
            "FERRY_API_TOKEN",
            "FERRY_EXECUTOR",
            "FERRY_RAY_ADDRESS",
            "FERRY_RAY_MAX_JOBS",
            "FERRY_RAY_CPUS_PER_JOB",
        )
    }
    env["FERRY_SHARED_DIR"] = str(tmp_path / "shared")
    first = Server(tmp_path / "data", env)
    first.start(timeout=90)
    try:
        with first.client() as client:
            job_id = submit(client, spec_yaml("ray-crash", steps=300, every=10))["id"]
            pid = ray_worker_pid(client, job_id)
            wait_for(client, job_id, lambda j: j["last_checkpoint"] is not None, timeout=60)
        first.kill()  # no shutdown code runs; Ray sees the job's owner gone and ends its actor
        psutil.Process(pid).wait(timeout=30)
    finally:
        first.stop()

    second = Server(tmp_path / "data", env)
    second.start(timeout=90)
    try:
        with second.client() as client:
            job = wait_status(client, job_id, "succeeded", "failed", timeout=150)
            assert job["status"] == "succeeded", job["error"]
            statuses = [e["data"]["status"] for e in all_events(client, job_id) if e["type"] == "status"]
            assert statuses == ["queued", "running", "interrupted", "queued", "running", "succeeded"]
    finally:
        second.stop()
