"""A real Ferry server on 127.0.0.1 in a subprocess, with its SQLite file and data dir in tmp_path."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.checking.checker import SpecCheckerProcess

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m service`` with FERRY_* settings; started, killed and restarted by the test."""

    def __init__(self, data_dir: Path, env: dict[str, str], argv: list[str] | None = None) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.argv = argv or [sys.executable, "-m", "service"]
        self.env = {
            **os.environ,
            "FERRY_HOST": "127.0.0.1",
            "FERRY_PORT": str(self.port),
            "FERRY_DATA_DIR": str(data_dir),
            "FERRY_DEVICES": "cpu",
            "FERRY_POLL_INTERVAL_S": "0.05",
            "FERRY_SHUTDOWN_GRACE_S": "5",
            "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p),
            **env,
        }
        self.process: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.data_dir.parent / f"server-{self.port}.log", "ab")  # noqa: SIM115
        # cwd outside the repo: the server must work from anywhere, with a data dir that does not exist yet.
        self.process = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.data_dir.parent,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited: {self.log_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready: {self.log_text()[-3000:]}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL the server: no shutdown code runs, as in a crash or power loss."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def log_text(self) -> str:
        path = self.data_dir.parent / f"server-{self.port}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def make(data_dir: Path | None = None, **env: str) -> Server:
        server = Server(data_dir or tmp_path / "data", {"FERRY_API_TOKEN": TOKEN, **env})
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server shared by the tests that do not need their own (starting one imports torch: seconds)."""
    root = tmp_path_factory.mktemp("ferry")
    server = Server(
        root / "data",
        {"FERRY_API_TOKEN": TOKEN, "FERRY_DATA_ROOTS": str(root / "datasets"), "FERRY_MAX_BODY_BYTES": "65536"},
    )
    (root / "datasets").mkdir()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def spec_checker() -> Iterator[SpecCheckerProcess]:
    """One spec checker process for the apps tests build in this process (each would import torch anew)."""
    checker = SpecCheckerProcess()
    checker.start()
    deadline = time.monotonic() + 180
    while not checker.ready and time.monotonic() < deadline:  # started, as a server's is by /ready
        time.sleep(0.05)
    yield checker
    checker.close()


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def wait_for(
    client: httpx.Client,
    job_id: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout: float = 90.0,
    interval: float = 0.1,
) -> dict[str, Any]:
    """Poll GET /v1/jobs/{id} until ``predicate(job)``."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if predicate(job):
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} stuck: {job['status']} {job.get('error')}")
        time.sleep(interval)


def wait_status(client: httpx.Client, job_id: str, *statuses: str, timeout: float = 90.0) -> dict[str, Any]:
    return wait_for(client, job_id, lambda job: job["status"] in statuses, timeout)


def spec_yaml(name: str = "smoke", steps: int = 40, every: int = 10) -> str:
    """A CPU job of a few seconds: a two-layer toy MLP on synthetic data, checkpointed every ``every`` steps."""
    return (
        f"name: {name}\n"
        "model: {kind: toy_mlp, hidden_size: 64, num_layers: 2}\n"
        "data: {kind: synthetic_regression}\n"
        f"training: {{steps: {steps}, batch_size: 8, optimizer: sgd, learning_rate: 0.01}}\n"
        f"checkpoint: {{every_steps: {every}, keep_last: 100}}\n"
        "device: cpu\n"
    )


def submit(client: httpx.Client, text: str, **headers: str) -> dict[str, Any]:
    response = client.post("/v1/jobs", content=text, headers={"Content-Type": "application/yaml", **headers})
    assert response.status_code == 201, response.text
    return response.json()
