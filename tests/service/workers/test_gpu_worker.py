"""On a GPU box: a job's process sees only the GPU its worker owns (run with `pytest -m gpu`)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest
import torch

from tests.service.api.test_api_jobs import all_events
from tests.service.conftest import Server, submit, wait_status

CUDA_JOB = """name: gpu-pinning
device: cuda
model: {kind: toy_mlp, hidden_size: 256, num_layers: 2}
data: {kind: synthetic_regression}
training: {steps: 5, batch_size: 8}
"""


def nvidia_smi_uuids() -> dict[str, str]:
    """GPU index (as the service's FERRY_DEVICES numbers them) → UUID, from nvidia-smi."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return dict(tuple(part.strip() for part in line.split(",")) for line in out.strip().splitlines())


@pytest.mark.gpu
def test_job_process_sees_only_its_assigned_gpu(make_server: Callable[..., Server]) -> None:
    last = str(torch.cuda.device_count() - 1)  # on a multi-GPU box this is not the default device 0
    server = make_server(FERRY_DEVICES=last)
    with server.client() as client:
        assert [w["device"] for w in client.get("/v1/workers").json()["data"]] == [last]
        job = submit(client, CUDA_JOB)
        done = wait_status(client, job["id"], "succeeded", "failed", timeout=300)
        assert done["status"] == "succeeded", done["error"]
        assert done["worker"] == f"gpu{last}" and done["memory"]["device_peak_bytes"] > 0
        assert f"with CUDA_VISIBLE_DEVICES='{last}'" in client.get(f"/v1/jobs/{job['id']}/logs").text
        # What the job's own process saw: one GPU, and it is the one nvidia-smi calls `last`.
        seen = next(e["data"]["device"] for e in all_events(client, job["id"]) if e["type"] == "started")
        assert seen["type"] == "cuda" and seen["visible_devices"] == 1
        assert seen["uuid"] == nvidia_smi_uuids()[last]
