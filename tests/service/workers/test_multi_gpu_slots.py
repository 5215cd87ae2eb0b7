"""Two GPU slots without GPUs (``FERRY_DEVICES=0,1``): one job per slot, each pinned to its own index, and
the queue feeds whichever slot frees first.

The jobs say ``device: cpu`` because this machine has no GPU. The scheduler hands any queued job to any
free slot, so they run on the GPU slots exactly as CUDA jobs would: the same claim, the same spawned
process with ``CUDA_VISIBLE_DEVICES`` set to the slot's index. Only the training itself is on the CPU.
What a real GPU adds (the job's memory on its own GPU, seen by nvidia-smi) is bench/multi_gpu.py's part.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import httpx

from tests.service.api.test_api_jobs import all_events
from tests.service.conftest import Server, spec_yaml, submit

SLOTS = {"gpu0": "0", "gpu1": "1"}
JOBS = 4
# Enough that a poll of /v1/workers every 50 ms sees each job hold its slot: with its process's start, seconds here.
STEPS = 100
# A freed slot is refilled on the scheduler's next tick (FERRY_POLL_INTERVAL_S=0.05 in these servers);
# this bound only has to tell "at once" from "after another job ended", so it is generous.
REFILL_S = 10.0
DEADLINE_S = 120.0


def watch_workers(client: httpx.Client) -> list[dict[str, tuple[str, int]]]:
    """Poll GET /v1/workers until no job is queued or running; each snapshot is {worker: (job id, pid)}."""
    snapshots: list[dict[str, tuple[str, int]]] = []
    deadline = time.monotonic() + DEADLINE_S
    while True:
        workers = client.get("/v1/workers").json()["data"]
        snapshots.append({w["id"]: (w["job_id"], w["pid"]) for w in workers if w["job_id"]})
        unfinished = client.get("/v1/jobs", params={"status": ["queued", "running"]}).json()["data"]
        if not unfinished:
            return snapshots
        left = [(job["name"], job["status"], job["worker"]) for job in unfinished]
        assert time.monotonic() < deadline, f"jobs not finished after {DEADLINE_S:.0f} s: {left}"
        time.sleep(0.05)


class SlotChange(NamedTuple):
    event_id: int
    at: float  # the server's clock
    kind: str  # "start" (queued -> running) or "end" (running -> anything)
    job_id: str
    worker: str


def slot_changes(client: httpx.Client, jobs: list[dict[str, Any]]) -> list[SlotChange]:
    """Every status change that takes or frees a slot, in the order the server made them.

    Event ids are one autoincrement over every job, written in the same transaction as the status change,
    so sorting by them is that order. Each job ran once, so its record's worker is the slot it held.
    """
    changes = []
    for job in jobs:
        for event in all_events(client, job["id"]):
            data = event["data"]
            if event["type"] != "status" or "running" not in (data["status"], data["previous"]):
                continue
            at = datetime.datetime.fromisoformat(event["created_at"]).timestamp()
            kind = "start" if data["status"] == "running" else "end"
            changes.append(SlotChange(event["id"], at, kind, job["id"], job["worker"]))
    return sorted(changes)


def test_two_gpu_slots_run_one_job_each_and_the_queue_feeds_the_first_free(
    make_server: Callable[..., Server],
) -> None:
    # No nvidia-smi here: the indices alone make the slots. A GPU slot's job keeps torch's default threads (one
    # per core); two of these CPU-bound toy jobs at once would then each wait on the other's threads for every
    # op (20x slower steps on two cores). One thread each keeps them as fast as a CPU slot's job.
    server = make_server(FERRY_DEVICES="0,1", OMP_NUM_THREADS="1")
    with server.client() as client:
        workers = client.get("/v1/workers").json()["data"]
        assert [(w["id"], w["device"], w["job_id"]) for w in workers] == [("gpu0", "0", None), ("gpu1", "1", None)]

        ids = [submit(client, spec_yaml(f"slot-{n}", steps=STEPS, every=STEPS))["id"] for n in range(JOBS)]
        snapshots = watch_workers(client)
        jobs = [client.get(f"/v1/jobs/{job_id}").json() for job_id in ids]
        logs = {job_id: client.get(f"/v1/jobs/{job_id}/logs").text for job_id in ids}
        changes = slot_changes(client, jobs)

    # All succeeded, each in one attempt on one GPU slot, its record naming that slot's index.
    assert [(j["status"], j["error"]) for j in jobs] == [("succeeded", None)] * JOBS
    assert all(j["attempt"] == 1 and j["retries"] == 0 for j in jobs)
    # device: cpu jobs on a GPU slot record no GPU index (ab96e1a: the jobs list says CPU for them)
    assert all(j["worker"] in SLOTS and j["device"] is None for j in jobs), jobs
    worker_of = {j["id"]: j["worker"] for j in jobs}

    # The server's own order of events: never two jobs on one slot; both slots busy at once.
    busy: dict[str, str] = {}
    most = 0
    for change in changes:
        if change.kind == "start":
            assert change.worker not in busy, f"{change.job_id} started on {change.worker} while {busy} ran"
            busy[change.worker] = change.job_id
            most = max(most, len(busy))
        else:
            assert busy.pop(change.worker) == change.job_id
    assert most == len(SLOTS) and not busy, changes

    # Oldest first: the first two start at once, and each of the others just after a slot freed.
    starts = [(n, change) for n, change in enumerate(changes) if change.kind == "start"]
    assert [change.job_id for _, change in starts] == ids
    assert [change.kind for change in changes[: len(SLOTS)]] == ["start"] * len(SLOTS), changes
    for n, start in starts[len(SLOTS) :]:
        freed = [change.at for change in changes[:n] if change.kind == "end"]
        assert freed and start.at - freed[-1] < REFILL_S, f"{start.job_id} not started as a slot freed: {changes}"

    # GET /v1/workers showed each job on its own worker while it ran, and both workers busy at once.
    shown = {(job_id, worker, pid) for snapshot in snapshots for worker, (job_id, pid) in snapshot.items()}
    assert {job_id for job_id, _, _ in shown} == set(ids), "a job never appeared in GET /v1/workers"
    assert all(worker_of[job_id] == worker for job_id, worker, _ in shown), shown
    assert any(len(snapshot) == len(SLOTS) for snapshot in snapshots)
    pids = {job_id: pid for job_id, _, pid in shown}
    assert len(pids) == len(shown) == JOBS, f"a job was shown with two pids or on two workers: {shown}"

    # Each job's own process logged the pid /v1/workers showed and its worker's CUDA_VISIBLE_DEVICES.
    for job_id, text in logs.items():
        started = re.findall(r"starting in pid (\d+) with CUDA_VISIBLE_DEVICES='(\d*)'", text)
        assert started == [(str(pids[job_id]), SLOTS[worker_of[job_id]])], text[-2000:]
