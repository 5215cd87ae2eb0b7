"""The job's event stream (GET /v1/jobs/{id}/events/stream, through sse-starlette): its framing, where it
starts (``after``, ``Last-Event-ID``), its end, and a clean end when the server shuts down."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.queue.status import JobStatus
from service.settings import Settings
from service.workers.executor import LocalProcessExecutor
from tests.service.conftest import Server, spec_yaml, submit, wait_for


def step(n: int) -> dict:
    return {"type": "step", "step": n, "total_steps": 5, "elapsed_s": 1.0, "eta_s": 1.0, "loss": 0.5, "lr": 0.1,
            "samples_per_s": 1.0}  # fmt: skip


@pytest.fixture
def finished_job(tmp_path: Path) -> Iterator[tuple[TestClient, str, list[int]]]:
    """A served app holding one succeeded job of five steps (written straight into its store)."""
    settings = Settings(data_dir=tmp_path / "data", devices="cpu", warm_start=False, _env_file=None)
    with TestClient(create_app(settings, executor=LocalProcessExecutor(warm=[]))) as client:
        store = client.app.state.store
        store.create_job(job_id="job-done", name="done", spec_text="name: done\n", spec={"name": "done"})
        store.claim_next(worker="test", device=None)
        store.append_events("job-done", 1, [step(n) for n in range(1, 6)])
        store.transition("job-done", JobStatus.SUCCEEDED, reason="written by the test")
        yield client, "job-done", [e.id for e in store.list_events("job-done", limit=100)]


def read_stream(client: TestClient, job_id: str, **request: object) -> str:
    with client.stream("GET", f"/v1/jobs/{job_id}/events/stream", **request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-store" and response.headers["x-accel-buffering"] == "no"
        return "".join(response.iter_text())


def frames(text: str) -> list[list[str]]:
    """The stream as its events, each the list of its lines."""
    return [block.split("\n") for block in text.split("\n\n") if block]


def test_the_stream_sends_retry_then_each_event_then_the_end(finished_job: tuple) -> None:
    client, job_id, ids = finished_job
    events = frames(read_stream(client, job_id, params={"after": ids[2]}))  # queued, running, step 1
    assert events[0] == ["retry: 2000"]
    sent = events[1:-1]
    kinds = ["step"] * 4 + ["status"]  # steps 2-5, then succeeded
    assert [lines[:2] for lines in sent] == [
        [f"id: {i}", f"event: {kind}"] for i, kind in zip(ids[3:], kinds, strict=True)
    ]
    assert all(lines[2].startswith('data: {"id":') and len(lines) == 3 for lines in sent)
    assert events[-1] == ["event: end", 'data: {"status": "succeeded"}']


def test_last_event_id_wins_over_after_and_a_bad_one_is_the_json_envelope(finished_job: tuple) -> None:
    client, job_id, ids = finished_job
    text = read_stream(client, job_id, params={"after": 0}, headers={"Last-Event-ID": str(ids[-2])})
    assert [lines[0] for lines in frames(text)[1:-1]] == [f"id: {ids[-1]}"]
    response = client.get(f"/v1/jobs/{job_id}/events/stream", headers={"Last-Event-ID": "12a"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"
    missing = client.get("/v1/jobs/job-none/events/stream")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_a_stream_open_when_the_server_stops_ends_cleanly(make_server: Callable[..., Server]) -> None:
    server = make_server()
    lines: list[str] = []
    outcome: list[BaseException | None] = []
    with server.client() as client:
        job = submit(client, spec_yaml("long", steps=10**6, every=10**6))
        wait_for(client, job["id"], lambda j: j["progress"] is not None)

        def follow() -> None:
            try:
                with client.stream("GET", f"/v1/jobs/{job['id']}/events/stream") as response:
                    lines.extend(response.iter_lines())
                outcome.append(None)
            except BaseException as error:  # the body cut off mid-chunk
                outcome.append(error)

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not any(line.startswith("event: step") for line in lines):
            assert time.monotonic() < deadline, "the stream sent no step"
            time.sleep(0.05)
        server.process.send_signal(signal.SIGINT)
        server.process.wait(timeout=60)
        reader.join(timeout=30)
    # The stream ended as a complete response, not cut off once uvicorn's shutdown grace ran out.
    assert outcome == [None], outcome
    assert "timeout graceful shutdown exceeded" not in server.log_text()
    assert server.process.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/ready", timeout=2)
