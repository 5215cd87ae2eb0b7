"""CPU per request of the two hot polls, in-process over ASGI: Ferry's app and the baseline app, no HTTP.

The dashboard mix (service_bench.py --mix) measures whole servers, where uvicorn's HTTP work (the same for
both apps) dilutes the difference and the machine's load adds noise. This drives each app's ASGI callable
directly with the mix's shape (four job reads per list read) on the same database file, in a process of
its own per app, and reports the least CPU time per request over several rounds.

    python bench/request_cpu.py [--requests 4500] [--rounds 9]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_db(db: Path) -> None:
    """One running job with a step's progress, and two queued ones: the mix's list holds three jobs."""
    sys.path.insert(0, str(REPO))
    from jobs.events import StepEvent
    from offload.stats import OffloadStats
    from service.queue.store import JobStore

    store = JobStore(db)
    store.create_job(job_id="job-1", name="bench", spec_text="name: bench\n", spec={"name": "bench"})
    store.claim_next(worker="cpu0", device=None)
    offload = OffloadStats(**dict.fromkeys(OffloadStats.__dataclass_fields__, 1))
    step = StepEvent(step=10, total_steps=1000, loss=0.5, lr=1e-4, samples_per_s=8.0, elapsed_s=0.1, eta_s=0.9)
    store.append_events("job-1", 1, [step.model_copy(update={"host_rss_bytes": 1 << 30, "offload": offload})])
    for n in range(2):
        store.create_job(job_id=f"job-q{n}", name=f"q{n}", spec_text="name: q\n", spec={"name": "q"})
    store.close()


def measure(which: str, db: Path, requests: int, rounds: int) -> float:
    """Microseconds of CPU per request, the least over ``rounds`` (run in this process)."""
    sys.path.insert(0, str(REPO))
    if which == "ferry":
        from service.api.app import create_app
        from service.queue.store import JobStore
        from service.settings import Settings

        settings = Settings(data_dir=db.parent, _env_file=None)
        app = create_app(settings)
        app.state.store, app.state.settings = JobStore(db), settings  # what the lifespan sets; no workers
    else:
        os.environ["FERRY_BASELINE_DB"] = str(db)
        from bench.baseline_app import app

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message

    def scope(path: str) -> dict:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                "headers": [(b"host", b"127.0.0.1")], "client": ("127.0.0.1", 50000),
                "server": ("127.0.0.1", 8000), "state": {}}  # fmt: skip

    async def run(n: int) -> None:
        for i in range(n):
            path = "/v1/jobs" if i % 5 == 4 else "/v1/jobs/job-1"
            await app(scope(path), receive, send)

    asyncio.run(run(200))  # warm-up: imports, caches, FastAPI's first-request setup
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        asyncio.run(run(requests // rounds))
        best = min(best, time.process_time() - started)
    return 1e6 * best / (requests // rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4500)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--app", choices=["ferry", "baseline"], help=argparse.SUPPRESS)  # the child's part
    parser.add_argument("--db", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.app:
        print(json.dumps(measure(args.app, args.db, args.requests, args.rounds)))
        return
    with tempfile.TemporaryDirectory(prefix="ferry-request-cpu-") as tmp:
        db = Path(tmp) / "ferry.sqlite3"
        build_db(db)
        result = {}
        for which in ("ferry", "baseline"):
            command = [sys.executable, __file__, "--app", which, "--db", str(db)]
            command += ["--requests", str(args.requests), "--rounds", str(args.rounds)]
            out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout
            result[which] = json.loads(out.strip().splitlines()[-1])
    ratio = result["ferry"] / result["baseline"]
    print(
        f"CPU per request, in-process: Ferry {result['ferry']:.0f} us, baseline {result['baseline']:.0f} us ({ratio:.2f}x)"
    )


if __name__ == "__main__":
    main()
