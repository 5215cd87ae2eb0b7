"""The open-loop dashboard mix for bench/service_bench.py, and the same mix on a minimal FastAPI + SQLite app.

Open loop: every request is sent at its scheduled time whether or not the earlier ones have been answered,
and its latency counts from that time (no coordinated omission). The mix, per second: each of ``clients``
job pages polls its job once (200 × 1/s), the jobs list is read ``list_rate`` times, and one SSE stream
replays a job of ``replay_events`` stored events from the start, again and again. The baseline app
(bench/baseline_app.py) reads the same rows from the same database file and gets the same job and list
polls (it has no stream), so the CPU per request of the two compares the frameworks' overheads fairly.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
REPLAY_JOB = "job-replay"


@dataclass
class MixResult:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0
    cpu_s: float = 0.0
    rss_bytes: int = 0
    replays: int = 0
    replay_s: list[float] = field(default_factory=list)
    replay_bytes: int = 0


def build_replay_job(db_path: Path, events: int) -> None:
    """A finished job of ``events`` step events in a fresh database, before any server opens it."""
    sys.path.insert(0, str(REPO))
    from service.queue.status import JobStatus
    from service.queue.store import JobStore

    store = JobStore(db_path)
    store.create_job(job_id=REPLAY_JOB, name="replay", spec_text="name: replay\n", spec={"name": "replay"})
    store.claim_next(worker="bench", device=None)
    step = {"type": "step", "total_steps": events, "elapsed_s": 1.0, "eta_s": 1.0, "loss": 1.0, "lr": 1e-4,
            "samples_per_s": 100.0, "host_rss_bytes": 1 << 30}  # fmt: skip
    for first in range(1, events + 1, 1000):
        store.append_events(REPLAY_JOB, 1, [{**step, "step": n} for n in range(first, min(first + 1000, events + 1))])
    store.transition(REPLAY_JOB, JobStatus.SUCCEEDED, reason="built by the bench")
    store.close()


def start_baseline(db_path: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    """bench/baseline_app.py under uvicorn, the same HTTP stack as Ferry's, without access logs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FERRY_BASELINE_DB": str(db_path), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "uvicorn", "bench.baseline_app:app", "--port", str(port), "--no-access-log"]
    log = open(workdir / "baseline.log", "wb")  # noqa: SIM115 - open for the server's lifetime
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/v1/jobs", timeout=1)
            return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"the baseline app did not start; see {workdir / 'baseline.log'}")


def run_mix(
    url: str, pid: int, job_id: str, *, seconds: float, clients: int, list_rate: int, stream: bool, headers: dict
) -> MixResult:
    """Run the mix against ``url`` and measure the server process ``pid`` (its CPU time and RSS)."""
    process = psutil.Process(pid)
    before = process.cpu_times()
    result = MixResult()
    asyncio.run(_mix(url, job_id, seconds, clients, list_rate, stream, headers, result))
    after = process.cpu_times()
    result.cpu_s = (after.user + after.system) - (before.user + before.system)
    result.rss_bytes = process.memory_info().rss
    return result


async def _mix(
    url: str,
    job_id: str,
    seconds: float,
    clients: int,
    list_rate: int,
    stream: bool,
    headers: dict,
    result: MixResult,
) -> None:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    start = time.monotonic() + 0.5  # every connection is open before the first scheduled request
    tasks = [
        _poller(host, int(port), f"/v1/jobs/{job_id}", start + i / clients, 1.0, seconds, headers, result)
        for i in range(clients)
    ]
    tasks += [
        _poller(host, int(port), "/v1/jobs", start + i / list_rate, 1.0, seconds, headers, result)
        for i in range(list_rate)
    ]
    if stream:
        tasks.append(_replayer(host, int(port), start, seconds, headers, result))
    await asyncio.gather(*tasks)


async def _poller(
    host: str, port: int, path: str, first: float, period: float, seconds: float, headers: dict, result: MixResult
) -> None:
    """One client, on one keep-alive connection: a GET at ``first``, ``first + period``, ... (open loop)."""
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    payload = (request + "\r\n").encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        scheduled = first
        while scheduled < first + seconds:
            await asyncio.sleep(max(0.0, scheduled - time.monotonic()))
            writer.write(payload)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            result.latencies.append(time.monotonic() - scheduled)  # from when it was due, not when sent
            result.requests += 1
            result.errors += not head.startswith(b"HTTP/1.1 200")
            scheduled += period
    except (OSError, asyncio.IncompleteReadError, StopIteration):
        result.errors += 1
    finally:
        writer.close()


async def _replayer(host: str, port: int, start: float, seconds: float, headers: dict, result: MixResult) -> None:
    """The job page of a finished 100k-event job opened from the first event, over and over."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    while time.monotonic() < start + seconds:
        await _replay(host, port, headers, result)


async def replay_once(url: str, result: MixResult, headers: dict | None = None) -> None:
    """One replay of the finished job's stream from its first event, counted into ``result``."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    await _replay(host, int(port), headers or {}, result)


async def _replay(host: str, port: int, headers: dict, result: MixResult) -> None:
    request = f"GET /v1/jobs/{REPLAY_JOB}/events/stream HTTP/1.1\r\nHost: {host}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()
    )
    began = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write((request + "Connection: close\r\n\r\n").encode())
    tail = b""
    try:
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            result.replay_bytes += len(chunk)
            tail = (tail + chunk)[-64:]
            if b"event: end" in tail:
                break
    finally:
        writer.close()
    result.replays += 1
    result.replay_s.append(time.monotonic() - began)
