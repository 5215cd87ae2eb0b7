"""A real server on 127.0.0.1 running real CPU jobs in spawned processes: the lifecycle end to end."""

from __future__ import annotations

import hashlib
import json

import httpx

from tests.service.conftest import REPO, Server, spec_yaml, submit, wait_for, wait_status

SMOKE = (REPO / "configs" / "cpu_smoke.yaml").read_text()  # 30 steps, checkpoints every 10, keeps the last 2


def all_events(client: httpx.Client, job_id: str, after: int = 0) -> list[dict]:
    events, has_more = [], True
    while has_more:
        page = client.get(f"/v1/jobs/{job_id}/events", params={"after": after, "limit": 25}).json()
        events += page["data"]
        after, has_more = page["next_cursor"], page["has_more"]
    return events


def sse_events(server: Server, job_id: str, last_event_id: int) -> list[dict]:
    """Read the stream as a reconnecting browser would, until the server says the job has ended."""
    received, kind = [], None
    headers = {"Authorization": "Bearer test-token-0123456789", "Last-Event-ID": str(last_event_id)}
    with httpx.stream("GET", f"{server.url}/v1/jobs/{job_id}/events/stream", headers=headers, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: ") and kind != "end":
                received.append(json.loads(line.removeprefix("data: ")))
            elif line.startswith("data: "):
                break
    return received


def test_cpu_job_succeeds_with_ordered_events_progress_and_verified_checkpoints(
    server: Server, client: httpx.Client
) -> None:
    job = submit(client, SMOKE)
    assert job["status"] == "queued" and job["spec"]["training"]["steps"] == 30 and job["spec_text"] == SMOKE

    running = wait_for(
        client,
        job["id"],
        lambda j: j["status"] == "running" and j["progress"] and j["progress"]["step"] >= 1,
        interval=0.02,
    )
    assert running["worker"] == "cpu0" and running["progress"]["total_steps"] == 30
    assert running["memory"]["host_rss_bytes"] > 0 and "loss" in running["metrics"]
    done = wait_status(client, job["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"]["step"] == 30 and done["progress"]["percent"] == 100.0

    events = all_events(client, job["id"])
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["status", "status", "started"] and kinds[-2:] == ["finished", "status"]
    assert [e["data"]["status"] for e in events if e["type"] == "status"] == ["queued", "running", "succeeded"]
    assert [e["data"]["step"] for e in events if e["type"] == "step"] == list(range(1, 31))
    assert [e["data"]["step"] for e in events if e["type"] == "checkpoint"] == [10, 20, 30]

    # A client that reconnects with Last-Event-ID gets exactly what came after.
    assert sse_events(server, job["id"], events[10]["id"]) == events[11:]

    series = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    assert [p["step"] for p in series] == list(range(1, 31)) and all("loss" in p for p in series)
    assert series[-1]["offload"]["h2d_bytes"] > 0  # the engine's own figures, per step
    assert client.get(f"/v1/jobs/{job['id']}/logs").status_code == 200

    checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
    assert [c["step"] for c in checkpoints] == [20, 30]  # keep_last: 2
    for entry in checkpoints[-1]["files"]:
        download = client.get(entry["url"])
        assert download.status_code == 200
        assert hashlib.sha256(download.content).hexdigest() == entry["sha256"] == download.headers["x-checksum-sha256"]
        assert len(download.content) == entry["bytes"]
        part = client.get(entry["url"], headers={"Range": "bytes=5-20"})
        assert part.status_code == 206 and part.content == download.content[5:21]


def test_pause_resume_cancel_and_409s(client: httpx.Client) -> None:
    job = submit(client, spec_yaml("pausable", steps=3000, every=1000))
    wait_for(client, job["id"], lambda j: j["progress"] is not None and j["progress"]["step"] >= 3)

    # While it holds the only CPU slot a second job stays queued; pausing or cancelling that is immediate.
    waiting = submit(client, spec_yaml("waiting"))
    assert client.post(f"/v1/jobs/{waiting['id']}/pause").json()["status"] == "paused"
    assert client.post(f"/v1/jobs/{waiting['id']}/cancel").json()["status"] == "cancelled"
    assert_409s(client, waiting["id"])
    response = client.delete(f"/v1/jobs/{job['id']}")
    assert (response.status_code, response.json()["error"]["message"]) == (
        409,
        (
            f"Job {job['id']} is running and cannot be deleted; only a succeeded, failed or cancelled job can be "
            "deleted. Cancel it first."
        ),
    )

    asked = client.post(f"/v1/jobs/{job['id']}/pause")
    assert asked.status_code == 200 and asked.json()["stop_requested"] == "pause"
    paused = wait_status(client, job["id"], "paused", timeout=30)
    paused_at = paused["last_checkpoint"]["step"]
    assert 3 <= paused_at < 3000 and paused["progress"]["step"] == paused_at

    assert client.post(f"/v1/jobs/{job['id']}/resume").json()["status"] == "queued"
    wait_for(client, job["id"], lambda j: j["attempt"] == 2 and j["progress"]["step"] > paused_at)
    started = [e for e in all_events(client, job["id"]) if e["type"] == "started"]
    assert [e["data"]["resumed_from_step"] for e in started] == [None, paused_at]

    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["stop_requested"] == "cancel"
    assert wait_status(client, job["id"], "cancelled", timeout=15)["finished_at"] is not None

    assert client.delete(f"/v1/jobs/{waiting['id']}").status_code == 204
    assert client.get(f"/v1/jobs/{waiting['id']}").status_code == 404


def assert_409s(client: httpx.Client, jid: str) -> None:
    expected = {
        "resume": f"Job {jid} is cancelled and cannot be resumed; only a paused, failed or interrupted job can "
        "be resumed.",
        "pause": f"Job {jid} is cancelled and cannot be paused; only a queued or running job can be paused.",
        "cancel": f"Job {jid} is cancelled and cannot be cancelled; only a queued, running, paused or "
        "interrupted job can be cancelled.",
    }
    for action, message in expected.items():
        response = client.post(f"/v1/jobs/{jid}/{action}")
        assert response.status_code == 409
        assert response.json() == {"error": {"code": "illegal_transition", "message": message}}
