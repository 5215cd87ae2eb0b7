"""Load on the service while a job trains: N concurrent clients poll the job's status for a fixed time.

Starts its own server on 127.0.0.1 (a fresh data dir in a temp directory, CPU worker) unless --url is given,
submits a CPU job, waits for its first step, then runs the clients. Reports requests/s, p50/p99 latency,
errors and the time from POST to the job's first step, and writes its row into bench/RESULTS.md between
the service_bench markers in place of the last run's (other sections of that file are left as they are).

    python bench/service_bench.py                      # 200 clients, 10 s
    python bench/service_bench.py --clients 50 --seconds 5 --no-write
    python bench/service_bench.py --mix                # the open-loop dashboard mix and its baseline
                                                       # (bench/dashboard_mix.py)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import platform
import statistics
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import dashboard_mix
import httpx
import local_server
import psutil
from doc_sections import replace_section

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "RESULTS.md"
SECTION = "service_bench"  # between <!-- service_bench:start --> and <!-- service_bench:end -->
SPEC = """name: bench
model: {kind: toy_mlp, hidden_size: 256, num_layers: 4}
data: {kind: synthetic_regression}
training: {steps: 100000, batch_size: 16, optimizer: adamw, learning_rate: 0.001}
checkpoint: {every_steps: 1000}
device: cpu
"""


def start_server(data_dir: Path) -> tuple[subprocess.Popen, str]:
    return local_server.start_server(
        data_dir.parent,
        {"FERRY_DATA_DIR": str(data_dir), "FERRY_DEVICES": "cpu", "FERRY_SHUTDOWN_GRACE_S": "5"},
        unset=("FERRY_API_TOKEN",),
        ready_timeout=180,
    )


def first_step_seconds(client: httpx.Client, job_id: str, posted_at: float) -> float:
    """From sending the POST to the job's first `step` event, by the server's event timestamps."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
        steps = [e for e in events if e["type"] == "step"]
        if steps:
            at = {e["type"] if e["type"] != "status" else e["data"]["status"]: _time(e) for e in reversed(events)}
            print(
                f"POST→running {at['running'] - posted_at:.2f} s, running→started (process start, imports, "
                f"model setup) {at['started'] - at['running']:.2f} s, started→first step "
                f"{at['step'] - at['started']:.2f} s"
            )
            return _time(steps[0]) - posted_at
        failed = [e for e in events if e["type"] == "failed"]
        if failed:
            raise SystemExit(f"the bench job failed: {failed[0]['data']}")
        time.sleep(0.05)
    raise SystemExit("the bench job never stepped")


def submit_and_time(client: httpx.Client, spec: str) -> tuple[str, float]:
    posted_at = time.time()
    job = client.post("/v1/jobs", content=spec, headers={"Content-Type": "application/yaml"}).json()
    return job["id"], first_step_seconds(client, job["id"], posted_at)


def smoke_cold_and_warm(client: httpx.Client) -> tuple[float, float]:
    """POST → first step of the CPU smoke job twice: the first job after start-up pays for the imports; the
    second finds the slot's spare process (FERRY_WARM_START) with its imports done, which its log confirms."""
    smoke = (REPO / "configs" / "cpu_smoke.yaml").read_text()
    times = []
    for _ in ("cold", "warm"):
        job_id, seconds = submit_and_time(client, smoke)
        wait_finished(client, job_id)
        times.append(seconds)
        time.sleep(SPARE_READY_S)
    print(f"POST→first step of the CPU smoke job: cold {times[0]:.2f} s, warm {times[1]:.3f} s")
    if "(a warm process:" not in client.get(f"/v1/jobs/{job_id}/logs").text:
        print(f"note: the warm smoke job did not find a ready spare within {SPARE_READY_S} s; its figure is not warm")
    return times[0], times[1]


SPARE_READY_S = 6.0  # for the slot's next spare to start (1 s after a hand-over) and import torch


def wait_finished(client: httpx.Client, job_id: str) -> None:
    while client.get(f"/v1/jobs/{job_id}").json()["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.2)


def _time(event: dict) -> float:
    return datetime.fromisoformat(event["created_at"]).timestamp()


async def poll(url: str, path: str, clients: int, seconds: float, headers: dict) -> tuple[list[float], int]:
    """``clients`` keep-alive connections, each sending its next GET as soon as the last answer is in.

    A minimal HTTP/1.1 client on asyncio streams: httpx's pool costs more CPU per request than the server
    does, which on a small machine would measure the client instead of the service.
    """
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request_bytes = (request + "\r\n").encode()
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds

    async def one_client() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while time.monotonic() < stop_at:
                start = time.perf_counter()
                writer.write(request_bytes)
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                latencies.append(time.perf_counter() - start)
                errors += not (head.startswith(b"HTTP/1.1 200") and b'"status":"running"' in body)
        except (OSError, asyncio.IncompleteReadError, StopIteration):
            errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(one_client() for _ in range(clients)))
    return latencies, errors


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def write_row(row: str) -> None:
    """Put this run's ``row`` in the service_bench section of bench/RESULTS.md, in place of the last run's.

    The section holds the current figure only; earlier runs are in git history.
    """
    header = (
        "| date (UTC) | machine | server HTTP stack | clients | seconds | requests | req/s | p50 ms | p99 ms | "
        "errors | POST→first step s, cold / warm | job steps during load |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    note = (
        "The clients poll `GET /v1/jobs/{id}` over keep-alive connections while a CPU job "
        "trains. Server, job and clients share the machine; `load` is its 1-minute load average at the end "
        "of the run, which includes any other work on it. POST→first step is the CPU smoke job's "
        "(configs/cpu_smoke.yaml): cold is the first job after start-up, warm the next one, which finds its "
        "slot's spare process with the imports done (FERRY_WARM_START).\n\n"
    )
    text = f"## Service: status polling under load (`bench/service_bench.py`)\n\n{note}{header}{row}"
    replace_section(RESULTS, SECTION, text, title="Benchmark results")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--url", help="use a running server instead of starting one")
    parser.add_argument("--token", help="bearer token for --url")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    parser.add_argument("--mix", action="store_true", help="the open-loop dashboard mix and its baseline instead")
    parser.add_argument("--list-rate", type=int, default=50, help="--mix: list reads per second")
    parser.add_argument("--replay-events", type=int, default=100_000, help="--mix: events of the replayed job")
    parser.add_argument(
        "--stream-only", type=int, metavar="N", help="the mix's stream alone: N replays, the server's CPU for each"
    )
    args = parser.parse_args()
    if args.stream_only:
        run_stream_only(args)
        return
    if args.mix:
        run_dashboard_mix(args)
        return

    tmp = tempfile.TemporaryDirectory(prefix="ferry-bench-")
    process, url = (None, args.url) if args.url else start_server(Path(tmp.name) / "data")
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            cold, warm = smoke_cold_and_warm(client)
            job_id, _ = submit_and_time(client, SPEC)
            job = {"id": job_id}
            step_before = client.get(f"/v1/jobs/{job['id']}").json()["progress"]["step"]
            latencies, errors = asyncio.run(poll(url, f"/v1/jobs/{job['id']}", args.clients, args.seconds, headers))
            step_after = client.get(f"/v1/jobs/{job['id']}").json()["progress"]["step"]
            client.post(f"/v1/jobs/{job['id']}/cancel")
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
        tmp.cleanup()

    commit = (
        subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        or "unknown"
    )
    machine = f"{platform.machine()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, commit {commit}"
    # uvicorn takes httptools and uvloop when installed (pyproject lists them), else h11 and asyncio.
    fast = all(importlib.util.find_spec(m) for m in ("httptools", "uvloop"))
    stack = "httptools+uvloop" if fast else "h11+asyncio"
    p50, p99 = percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3
    row = (
        f"| {datetime.now(UTC):%Y-%m-%d %H:%M} | {machine} | {stack} | {args.clients} | {args.seconds:g} | "
        f"{len(latencies)} | {len(latencies) / args.seconds:.0f} | {p50:.1f} | {p99:.1f} | {errors} | "
        f"{cold:.1f} / {warm:.2f} | {step_after - step_before} |"
    )
    print(row)
    if not args.no_write:
        write_row(row)


def run_dashboard_mix(args: argparse.Namespace) -> None:
    """Ferry under the open-loop dashboard mix while a job trains, then the baseline app on the same rows."""
    tmp = tempfile.TemporaryDirectory(prefix="ferry-mix-")
    data = Path(tmp.name) / "data"
    dashboard_mix.build_replay_job(data / "ferry.sqlite3", args.replay_events)
    process, url = start_server(data)
    baseline = None
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            cold, warm = smoke_cold_and_warm(client)
            job_id, _ = submit_and_time(client, SPEC)
            mix = dict(seconds=args.seconds, clients=args.clients, list_rate=args.list_rate, headers={})
            ferry = dashboard_mix.run_mix(url, process.pid, job_id, stream=True, **mix)
            # CPU per request is compared on the polls alone: the baseline has no stream to serve.
            polls = dashboard_mix.run_mix(url, process.pid, job_id, stream=False, **mix)
            baseline, base_url = dashboard_mix.start_baseline(data / "ferry.sqlite3", Path(tmp.name))
            base = dashboard_mix.run_mix(base_url, baseline.pid, job_id, stream=False, **mix)
            client.post(f"/v1/jobs/{job_id}/cancel")
    finally:
        for proc in (process, baseline):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
        tmp.cleanup()
    rows = [
        _mix_row("Ferry, the mix", ferry, warm, cold),
        _mix_row("Ferry, polls only", polls, None, None),
        _mix_row("baseline: FastAPI + SQLite, polls only", base, None, None),
    ]
    ratio = (polls.cpu_s / polls.requests) / (base.cpu_s / base.requests)
    summary = (
        f"CPU per request {ratio:.2f}× the baseline's (target ≤ 1.3×); replays of the {args.replay_events}-event "
        f"job: {ferry.replays}, {statistics.mean(ferry.replay_s) if ferry.replay_s else 0:.1f} s and "
        f"{ferry.replay_bytes / max(1, ferry.replays) / 2**20:.1f} MiB each"
    )
    print("\n".join(rows) + "\n" + summary)
    if not args.no_write:
        _write_mix(rows, summary, args)


def run_stream_only(args: argparse.Namespace) -> None:
    """The mix's SSE replay of a finished job alone, ``args.stream_only`` times in a row, on an idle server:
    per replay its wall time, the server's CPU time and the bytes, to compare stream implementations."""
    tmp = tempfile.TemporaryDirectory(prefix="ferry-stream-")
    data = Path(tmp.name) / "data"
    dashboard_mix.build_replay_job(data / "ferry.sqlite3", args.replay_events)
    process, url = start_server(data)
    try:
        server = psutil.Process(process.pid)
        for n in range(args.stream_only):
            result = dashboard_mix.MixResult()
            before = server.cpu_times()
            asyncio.run(dashboard_mix.replay_once(url, result))
            after = server.cpu_times()
            cpu = (after.user + after.system) - (before.user + before.system)
            print(
                f"replay {n + 1}: {result.replay_s[0]:.2f} s, server CPU {cpu:.2f} s, "
                f"{result.replay_bytes / 2**20:.1f} MiB for {args.replay_events} events ({_machine()})"
            )
    finally:
        process.terminate()
        process.wait(timeout=60)
        tmp.cleanup()


def _mix_row(name: str, r: dashboard_mix.MixResult, warm: float | None, cold: float | None) -> str:
    ms = sorted(x * 1e3 for x in r.latencies)
    p50, p99, worst = percentile(ms, 50), percentile(ms, 99), ms[-1]
    first = f"{cold:.1f} / {warm:.2f}" if warm is not None else "–"
    return (
        f"| {datetime.now(UTC):%Y-%m-%d %H:%M} | {_machine()} | {name} | {r.requests} | {r.errors} | {p50:.1f} | "
        f"{p99:.1f} | {worst:.1f} | {1e3 * r.cpu_s / max(1, r.requests):.2f} | {r.rss_bytes / 2**20:.0f} | {first} |"
    )


def _machine() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return f"{platform.machine()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, commit {commit.stdout.strip()}"


MIX_SECTION = "dashboard_mix"


def _write_mix(rows: list[str], summary: str, args: argparse.Namespace) -> None:
    """Put this run's rows and summary in the dashboard_mix section of bench/RESULTS.md, in place of the last
    run's (earlier runs are in git history)."""
    dated = f"- {datetime.now(UTC):%Y-%m-%d %H:%M}, {_machine()}: {summary}."
    text = (
        "## Service: the open-loop dashboard mix (`bench/service_bench.py --mix`)\n\n"
        f"`python bench/service_bench.py --mix --seconds {args.seconds:g}`: per second, {args.clients} job pages "
        f"poll their job once, the list is read {args.list_rate} times, and one SSE stream replays a finished "
        f"job of {args.replay_events} events from the start, over and over, while a CPU job trains. Latency "
        "counts from each request's scheduled time. The baseline (bench/baseline_app.py) reads the same rows "
        "from the same file on the same HTTP stack and gets the same polls (no stream); CPU per request is "
        "compared on the polls alone (Ferry, polls only). Server, job and "
        "clients share the machine (its load average is in the row). RSS is the API process's alone (the "
        "spec checker and the job processes are processes of their own).\n\n"
        "| date (UTC) | machine | server | requests | errors | p50 ms | p99 ms | max ms | CPU ms/request | "
        "RSS MiB | POST→first step s, cold / warm |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
        + dated
    )
    replace_section(RESULTS, MIX_SECTION, text, title="Benchmark results")


if __name__ == "__main__":
    main()
