"""Where the API process spends a request's CPU: the dashboard mix's polls against a server run under cProfile.

Starts ``python -m cProfile -m service`` on a fresh data directory, trains a CPU job, sends the mix's job
and list polls (bench/dashboard_mix.py, no stream) for ``--seconds``, stops the server and prints the
functions with the most cumulative and own time. The numbers are cProfile's (it slows every call); what
counts is the share each part takes.

    python bench/profile_requests.py --seconds 10 [--top 40]
"""

from __future__ import annotations

import argparse
import pstats
import signal
import tempfile
from pathlib import Path

import dashboard_mix
import httpx
from local_server import start_server
from service_bench import SPEC, submit_and_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--list-rate", type=int, default=50)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ferry-profile-") as tmp:
        profile = Path(tmp) / "server.prof"
        settings = {"FERRY_DATA_DIR": str(Path(tmp) / "data"), "FERRY_DEVICES": "cpu"}
        process, url = start_server(
            Path(tmp), settings, unset=("FERRY_API_TOKEN",), python_args=("-m", "cProfile", "-o", str(profile))
        )
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


if __name__ == "__main__":
    main()
