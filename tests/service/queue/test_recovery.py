"""Crash consistency: a server and its job killed mid-run; the next server resumes the job from its checkpoint."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx

from tests.service.api.test_api_jobs import all_events
from tests.service.conftest import Server, spec_yaml, submit, wait_for, wait_status


def weights(client: httpx.Client, job_id: str) -> dict[str, str]:
    """SHA-256 of each weights file in the job's final checkpoint."""
    final = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"][-1]
    return {f["name"]: f["sha256"] for f in final["files"] if f["name"].endswith(".safetensors")}


def process_of(client: httpx.Client, job_id: str, timeout: float = 60.0) -> int:
    """The pid GET /v1/workers shows for ``job_id`` once its process runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [w["pid"] for w in client.get("/v1/workers").json()["data"] if w["job_id"] == job_id and w["pid"]]
        if pids:
            return pids[0]
        time.sleep(0.05)
    raise TimeoutError(f"no worker shows a process for {job_id}")


def test_sigkilled_job_resumes_after_restart_and_ends_with_the_same_weights(
    make_server: Callable[..., Server],
) -> None:
    steps = 120  # far more than the 15 it waits for: the job must still be running when it is killed
    spec = spec_yaml("recover", steps=steps, every=10)
    first = make_server()
    with first.client() as client:
        victim = submit(client, spec)["id"]
        pid = process_of(client, victim)
        wait_for(client, victim, lambda j: j["progress"] is not None and j["progress"]["step"] >= 15)
    first.kill()  # a crash or power loss: no shutdown code runs
    os.kill(pid, signal.SIGKILL)

    second = make_server(data_dir=first.data_dir, FERRY_CPU_WORKERS="2")
    with second.client() as client:
        reference = submit(client, spec)["id"]  # the same job, never interrupted
        for job_id in (victim, reference):
            job = wait_status(client, job_id, "succeeded", "failed", timeout=180)
            assert job["status"] == "succeeded", job["error"]

        events = all_events(client, victim)
        assert [e["data"]["status"] for e in events if e["type"] == "status"] == [
            "queued",
            "running",
            "interrupted",
            "queued",
            "running",
            "succeeded",
        ]
        interrupted = next(e for e in events if e["data"].get("status") == "interrupted")
        assert interrupted["data"]["reason"] == f"the server restarted and the job's process (pid {pid}) was gone"
        resumed_from = [e["data"]["resumed_from_step"] for e in events if e["type"] == "started"]
        saved_before_kill = [e["data"]["step"] for e in events if e["type"] == "checkpoint" and e["attempt"] == 1]
        assert resumed_from[0] is None and resumed_from[1] >= max(saved_before_kill) >= 10
        steps_after = [e["data"]["step"] for e in events if e["type"] == "step" and e["attempt"] == 2]
        assert steps_after == list(range(resumed_from[1] + 1, steps + 1))  # no step redone from 0

        assert client.get(f"/v1/jobs/{victim}").json()["retries"] == 1
        assert weights(client, victim) == weights(client, reference) != {}
