"""A really full disk, not an injected error: the server runs on a small tmpfs of its own, mounted in a user
and mount namespace (no root needed where unprivileged user namespaces are allowed; skipped elsewhere,
e.g. where AppArmor restricts them). A job fills the disk with checkpoints and fails naming it; /ready
says so; with the disk filled to the last byte a submit is refused with 507 and a delete still works; once
the job is deleted the service takes work again.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.conftest import TOKEN, Server, spec_yaml, submit, wait_status

SIZE_MIB = 48  # room for the database, the 8 MiB reserve (service/queue/disk.py) and about two checkpoints
MIN_FREE = 12 << 20  # FERRY_MIN_FREE_DISK_BYTES: under this, /ready says disk_low and submits get 507
# About 17 MB of weights per checkpoint, one checkpoint per step, all kept: the third one does not fit.
FILLER = """name: filler
model: {kind: toy_mlp, hidden_size: 1024, num_layers: 4}
data: {kind: synthetic_regression}
training: {steps: 40, batch_size: 4, optimizer: sgd, learning_rate: 0.01}
checkpoint: {every_steps: 1, keep_last: 100}
device: cpu
"""


def namespaces_work(tmp_path: Path) -> str | None:
    """None if this user can mount a tmpfs in a namespace of its own; else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    point = tmp_path / "probe"
    point.mkdir()
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "-o", "size=1m", "none", point],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a user namespace: {probe.stderr.strip()}"


class TinyDiskServer(Server):
    """``python -m service`` whose data directory is a fresh tmpfs of ``SIZE_MIB`` only it can see."""

    def __init__(self, data_dir: Path, env: dict[str, str]) -> None:
        mount = f'mount -t tmpfs -o size={SIZE_MIB}m none "$FERRY_DATA_DIR" && exec "$0" -m service'
        super().__init__(
            data_dir, env, ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, sys.executable]
        )

    def start(self, timeout: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True)  # the mount point
        super().start(timeout)


@pytest.fixture
def tiny_disk_server(tmp_path: Path) -> Iterator[Server]:
    reason = namespaces_work(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    env = {"FERRY_API_TOKEN": TOKEN, "FERRY_MIN_FREE_DISK_BYTES": str(MIN_FREE), "FERRY_MAX_RETRIES": "0"}
    server = TinyDiskServer(tmp_path / "data", env)
    server.start()
    yield server
    server.stop()


def fill_up(server: Server) -> Path:
    """Write a file into the server's tmpfs (seen through /proc/<pid>/root) until no byte is left."""
    filler = Path(f"/proc/{server.process.pid}/root") / server.data_dir.relative_to("/") / "filler"
    with filler.open("wb") as f, pytest.raises(OSError, match="No space left on device"):
        while True:
            f.write(b"\0" * (1 << 16))
            f.flush()
    return filler


def test_a_job_that_fills_a_real_disk_leaves_a_service_that_says_so_and_recovers(tiny_disk_server: Server) -> None:
    with tiny_disk_server.client() as client:
        job = submit(client, FILLER)["id"]
        failed = wait_status(client, job, "failed", "succeeded", timeout=120)
        # The third checkpoint does not fit: the job fails, naming the disk, and does not stay running.
        assert failed["status"] == "failed" and "No space left on device" in failed["error"]["message"], failed
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "disk_low", ready.text

        fill_up(tiny_disk_server)  # and now not one byte is left
        refused = client.post("/v1/jobs", content=spec_yaml("later"), headers={"Content-Type": "application/yaml"})
        assert refused.status_code == 507 and refused.json()["error"]["code"] == "insufficient_storage"
        assert client.get("/ready").status_code == 503
        # Delete works on the full disk (SQLite needs room to delete rows; the reserve gives it) and frees
        # the job's checkpoints, so the service takes work again.
        assert client.delete(f"/v1/jobs/{job}").status_code == 204
        assert "giving back the ferry.reserve reserve" in tiny_disk_server.log_text()
        assert client.get("/ready").status_code == 200
        after = submit(client, spec_yaml("after", steps=3, every=3))["id"]
        assert wait_status(client, after, "succeeded", "failed")["status"] == "succeeded"
