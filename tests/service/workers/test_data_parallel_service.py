"""A job of two ranks through the service on the CPU (gloo): queued, both ranks run in the job's one slot,
its events and checkpoints come once (rank 0 writes them), and a cancel stops both ranks."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

from tests.service.api.test_api_jobs import all_events
from tests.service.conftest import Server, spec_yaml, submit, wait_for, wait_status

TWO_RANKS = "distributed: {world_size: 2}\n"


def ranks_of(pid: int) -> list[psutil.Process]:
    """The rank processes under the job's process (spawned by torch's launcher: multiprocessing's spawn)."""
    children = psutil.Process(pid).children(recursive=True)
    return [
        p for p in children if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
    ]


def test_a_two_rank_job_reports_once_and_a_cancel_stops_both_ranks(make_server: Callable[..., Server]) -> None:
    server = make_server(FERRY_CPU_WORKERS="1")
    with server.client() as client:
        done = submit(client, spec_yaml("two-ranks", steps=20, every=10) + TWO_RANKS)
        finished = wait_status(client, done["id"], "succeeded", "failed", timeout=120)
        assert finished["status"] == "succeeded", finished["error"]
        assert finished["worker"] == "cpu0" and finished["attempt"] == 1
        events = all_events(client, done["id"])
        kinds = [e["type"] for e in events]
        assert kinds.count("started") == kinds.count("finished") == 1
        assert [e["data"]["step"] for e in events if e["type"] == "step"] == list(range(1, 21))
        assert all([r["rank"] for r in e["data"]["ranks"]] == [0, 1] for e in events if e["type"] == "step")
        assert [e["data"]["step"] for e in events if e["type"] == "checkpoint"] == [10, 20]
        assert [c["step"] for c in client.get(f"/v1/jobs/{done['id']}/checkpoints").json()["data"]] == [10, 20]

        long = submit(client, spec_yaml("cancelled", steps=100_000, every=100_000) + TWO_RANKS)
        running = wait_for(client, long["id"], lambda j: bool(j["progress"]) and j["progress"]["step"] >= 2)
        pid = next(w["pid"] for w in client.get("/v1/workers").json()["data"] if w["job_id"] == long["id"])
        ranks = ranks_of(pid)
        assert len(ranks) == 2, [p.cmdline() for p in ranks]
        assert client.post(f"/v1/jobs/{running['id']}/cancel").status_code == 200
        assert wait_status(client, long["id"], "cancelled")["status"] == "cancelled"
        deadline = time.monotonic() + 30
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks):
            assert time.monotonic() < deadline, "a rank outlived its cancelled job"
            time.sleep(0.1)
