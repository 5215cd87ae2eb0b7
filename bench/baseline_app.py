"""The baseline for bench/dashboard_mix.py: a minimal FastAPI + SQLite app answering the same two reads.

It reads the same rows from the same database file as Ferry and returns them as JSON with no validation,
no auth, no middleware: what any FastAPI service over SQLite costs per request. Run by the bench as

    FERRY_BASELINE_DB=/path/ferry.sqlite3 uvicorn bench.baseline_app:app --port N --no-access-log
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading

from fastapi import FastAPI, HTTPException

DB = os.environ.get("FERRY_BASELINE_DB", "ferry.sqlite3")
_local = threading.local()
app = FastAPI()


def _conn() -> sqlite3.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = sqlite3.connect(DB, check_same_thread=False)
        conn.row_factory = sqlite3.Row
    return conn


@app.get("/v1/jobs/{job_id}")
async def read_job(job_id: str) -> dict:
    row = _conn().execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        raise HTTPException(404)
    job = dict(row)
    job["progress"] = json.loads(job.pop("progress_json") or "null")
    return job


@app.get("/v1/jobs")
async def list_jobs() -> dict:
    rows = _conn().execute("SELECT id, name, status, progress_json FROM jobs ORDER BY seq DESC LIMIT 50").fetchall()
    return {"data": [{**dict(r), "progress_json": json.loads(r["progress_json"] or "null")} for r in rows]}
