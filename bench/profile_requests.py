"""Where the API process spends a request's CPU: the dashboard mix's polls against a server run under cProfile.

Starts ``python -m cProfile -m service`` on a fresh data directory, trains a CPU job, sends the mix's job
and list polls (bench/dashboard_mix.py, no stream) for ``--seconds``, stops the server and prints the
functions with the most cumulative and own time. The numbers are cProfile's (it slows every call); what
counts is the share each part takes.

    python bench/profile_requests.py --seconds 10 [--top 40]
"""

from __future__ import annotations

import argparse
import os
import pstats
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dashboard_mix
import httpx
from service_bench import SPEC, submit_and_time

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--list-rate", type=int, default=50)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ferry-profile-") as tmp:
        profile = Path(tmp) / "server.prof"
        process, url = _start(Path(tmp), profile)
        try:
            with httpx.Client(base_url=url, timeout=30) as client:
                job_id, _ = submit_and_time(client, SPEC)
                mix = dict(seconds=args.seconds, clients=args.clients, list_rate=args.list_rate, headers={})
                result = dashboard_mix.run_mix(url, process.pid, job_id, stream=False, **mix)
                client.post(f"/v1/jobs/{job_id}/cancel")
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)
        print(f"{result.requests} requests, {1e3 * result.cpu_s / max(1, result.requests):.2f} ms CPU each (profiled)")
        stats = pstats.Stats(str(profile))
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)


def _start(workdir: Path, profile: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "FERRY_HOST": "127.0.0.1",
        "FERRY_PORT": str(port),
        "FERRY_DATA_DIR": str(workdir / "data"),
        "FERRY_DEVICES": "cpu",
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p),
    }
    env.pop("FERRY_API_TOKEN", None)
    command = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "service"]
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - open for the server's lifetime
    process = subprocess.Popen(command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not become ready; see {workdir / 'server.log'}")


if __name__ == "__main__":
    main()
