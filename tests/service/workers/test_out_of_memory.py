"""Out of memory is ``out_of_memory`` end to end: the runner's failed event, the child that stores it, the
scheduler that fails the job, the API, and the dashboard's reading of the API's JSON.

The job runs in this process (an in-process executor calling the child's own entry point), so the CUDA
out-of-memory error can be injected where a real one would rise: in the training step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

import jobs.train.runner
from service.api.app import create_app
from service.checking.checker import SpecChecker
from service.queue.store import JobStore
from service.settings import Settings
from service.workers.executor.base import LaunchRequest
from service.workers.executor.child import run_attempt

DASHBOARD = Path(__file__).resolve().parents[3] / "service" / "dashboard" / "static"
SPEC = """\
name: oom
model: {kind: toy_mlp, hidden_size: 16, num_layers: 2}
data: {kind: synthetic_regression}
training: {steps: 3}
device: cpu
"""


class InProcessHandle:
    """One attempt on a thread of this process, through the same entry point as a spawned child."""

    def __init__(self, request: LaunchRequest) -> None:
        self.pid, self.started_at, self.code = None, None, None
        self._thread = threading.Thread(target=self._run, args=(request,), daemon=True)
        self._thread.start()

    def _run(self, request: LaunchRequest) -> None:
        store = JobStore(request.db_path)
        try:
            self.code = run_attempt(request, store, lambda: None)
        finally:
            store.close()

    def exit_code(self) -> int | None:
        return self.code

    def exit_reason(self) -> str | None:
        return None

    def request_stop(self, kind: str) -> None:
        pass

    def kill(self) -> None:
        pass


class InProcessExecutor:
    def launch(self, request: LaunchRequest) -> InProcessHandle:
        return InProcessHandle(request)

    def keep_warm(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stop_orphan(self, pid: int | None, started_at: float | None, *, grace_s: float) -> None:
        pass


def _no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _failed_job(client: TestClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] != "failed":
        assert job["status"] in ("queued", "running") and time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


def _dashboard_reads(job: dict[str, Any]) -> dict[str, Any]:
    """What the dashboard's model.js makes of the API's JSON (run by node, as the browser would)."""
    script = (
        f"import {{ normalizeJob }} from {json.dumps((DASHBOARD / 'model.js').as_uri())};\n"
        f"const job = normalizeJob({json.dumps(job)});\n"
        "console.log(JSON.stringify({ error: job.error, actions: job.actions }));\n"
    )
    done = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_out_of_memory_is_out_of_memory_from_runner_to_dashboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec_checker: SpecChecker
) -> None:
    monkeypatch.setattr(jobs.train.runner, "train_step", _no_memory)
    settings = Settings(data_dir=tmp_path, devices="cpu", poll_interval_s=0.02, _env_file=None)
    with TestClient(create_app(settings, executor=InProcessExecutor(), spec_checker=spec_checker)) as client:
        submitted = client.post("/v1/jobs", content=SPEC, headers={"Content-Type": "application/yaml"})
        assert submitted.status_code == 201, submitted.text
        job = _failed_job(client, submitted.json()["id"])
        events = client.get(f"/v1/jobs/{job['id']}/events").json()["data"]

    assert job["error"]["code"] == "out_of_memory"
    assert "To fit: set offload.enable_model_cpu_offload: true" in job["error"]["message"]
    assert job["allowed_actions"] == ["resume", "delete"]
    failed = next(e["data"] for e in events if e["type"] == "failed")
    assert (failed["error"], failed["exception"]) == ("out_of_memory", "OutOfMemoryHint")
    status = [e["data"] for e in events if e["type"] == "status"][-1]
    assert (status["status"], status["error"]["code"]) == ("failed", "out_of_memory")
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the dashboard half needs it (CI installs it for the dashboard)")
    seen = _dashboard_reads(job)
    assert seen["error"]["code"] == "out_of_memory" and seen["actions"] == ["resume", "delete"]
