"""Database bytes per step of a long job, with and without the step-event retention (service/queue/retention.py).

Writes the step events of an N-step job the way a job's process does (batches of 64) into a fresh store,
compacting as the scheduler does (every 640 steps here), and reports the events kept and the file's size.
Prints a table and writes it into bench/RESULTS.md between the event_retention markers.

    python bench/event_retention_bench.py              # 100k steps
    python bench/event_retention_bench.py --steps 20000 --no-write
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "RESULTS.md"
START, END = "<!-- event_retention:start -->", "<!-- event_retention:end -->"

from service.queue.retention import StepRetention  # noqa: E402
from service.queue.store import JobStore  # noqa: E402


def step(n: int, total: int) -> dict:
    """A CPU job's step event as the runner sends it (figures of a realistic size)."""
    return {"type": "step", "step": n, "total_steps": total, "elapsed_s": n * 0.01, "eta_s": 1.0, "loss": 1.0 / n,
            "lr": 1e-4, "samples_per_s": 800.0, "device_allocated_bytes": 123456789, "device_reserved_bytes": 223456789,
            "device_peak_bytes": 323456789, "host_rss_bytes": 1234567890, "pinned_bytes": 987654321}  # fmt: skip


def measure(steps: int, retention: StepRetention | None) -> tuple[int, int, float]:
    """(step events kept, database bytes, seconds) for a job of ``steps`` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        store = JobStore(Path(tmp) / "ferry.sqlite3")
        store.create_job(job_id="a", name="a", spec_text="", spec={})
        mark, began = 0, time.perf_counter()
        for first in range(1, steps + 1, 64):
            store.append_events("a", 1, [step(n, steps) for n in range(first, min(first + 64, steps + 1))])
            if retention is not None and first % 640 == 1:
                mark = store.compact_steps("a", mark, retention)
        if retention is not None:
            store.compact_steps("a", mark, retention)
        seconds = time.perf_counter() - began
        store.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        kept = store.db.conn.execute("SELECT COUNT(*) FROM events WHERE type = 'step'").fetchone()[0]
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        store.close()
    return kept, size, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, retention in (("none (before)", None), ("first 1000, then 3 per 100 (default)", StepRetention())):
        kept, size, seconds = measure(args.steps, retention)
        rows.append(
            f"| {datetime.now(UTC):%Y-%m-%d %H:%M} | {platform.machine()} {os.cpu_count()} CPUs | {name} | "
            f"{args.steps} | {kept} | {size / 2**20:.1f} | {size / args.steps:.0f} | {seconds:.1f} |"
        )
    table = (
        "| date (UTC) | machine | retention | steps | step events kept | database MiB | bytes per step | "
        "write + compact s |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    print(table)
    if args.no_write:
        return
    text = RESULTS.read_text()
    before, after = (text.split(START)[0], text.split(END, 1)[1]) if START in text else (text.rstrip() + "\n\n", "\n")
    section = (
        f"{START}\n## Service: database bytes per step (`bench/event_retention_bench.py`)\n\n"
        f"`python bench/event_retention_bench.py --steps {args.steps}`: a job's step events written in batches of "
        "64 as its process writes them, compacted every 640 steps as the scheduler does.\n\n"
        f"{table}\n{END}"
    )
    RESULTS.write_text(before + section + after)


if __name__ == "__main__":
    main()
