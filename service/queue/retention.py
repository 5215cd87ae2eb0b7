"""Retention of per-step events: every step of a job's start, then a few points per window of steps.

A fast small job reports a step event many times a second; kept whole, a long job's events would grow the
database without bound (bench/event_retention_bench.py measures it). The first ``keep_first`` steps stay whole
(where a curve changes most). After that, each complete window of ``window`` steps keeps three or four points: its last
step, the steps with the lowest and the highest loss, and its first non-finite loss, so a spike, a dip or the
step where a job diverged never disappears from the curve.
Other events (status, checkpoints, evaluations) are never touched. The job row keeps the latest step whatever is
compacted.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from service.queue.stored_json import finite


@dataclass(frozen=True)
class StepRetention:
    """How many steps stay whole, and the window each later group of steps is reduced over.

    Example:
        StepRetention(keep_first=1000, window=100)  # a 100k-step job keeps about 4,000 step events
    """

    keep_first: int = 1000
    window: int = 100


def compact_steps(conn: sqlite3.Connection, job_id: str, after_id: int, retention: StepRetention) -> int:
    """Reduce each complete window of the job's step events with id > ``after_id``; returns the id to pass
    as ``after_id`` next time (the last window compacted, so each row is read about once). Call inside a
    transaction.
    """
    rows = conn.execute(
        "SELECT id, json_extract(data, '$.step') AS step, json_extract(data, '$.loss') AS loss FROM events"
        " WHERE job_id = ? AND type = 'step' AND id > ? ORDER BY id",
        (job_id, after_id),
    ).fetchall()
    windows: dict[int, list[sqlite3.Row]] = {}
    for row in rows:
        if row["step"] is not None and row["step"] > retention.keep_first:
            windows.setdefault((row["step"] - retention.keep_first - 1) // retention.window, []).append(row)
    if not windows:
        return after_id
    newest = max(windows)  # still filling: left whole until a later step closes it
    done = [windows[w] for w in sorted(windows) if w < newest]
    doomed: list[int] = []
    for group in done:
        keep = {group[-1]["id"]}
        losses = [(loss, r["id"]) for r in group if (loss := finite(r["loss"])) is not None]
        if losses:
            keep |= {min(losses, key=lambda t: t[0])[1], max(losses, key=lambda t: t[0])[1]}
        # A non-finite loss (stored as "NaN" or "Infinity": stored_json.py) is the highest spike of all: the
        # window keeps its first one, so the step where the job diverged stays on the curve.
        diverged = next((r["id"] for r in group if isinstance(r["loss"], str)), None)
        if diverged is not None:
            keep.add(diverged)
        doomed += [r["id"] for r in group if r["id"] not in keep]
    conn.executemany("DELETE FROM events WHERE id = ?", [(i,) for i in doomed])
    return max(r["id"] for r in done[-1]) if done else after_id
