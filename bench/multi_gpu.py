"""One job per GPU: N LoRA jobs with model offload submitted at once to a service with a worker per GPU, and
watched while they run (GET /v1/workers, each job's record, nvidia-smi's processes). Checks that as many run
at once as there are GPUs, each alone on its GPU, that queued jobs start as a GPU frees and that all succeed.
Writes multi_gpu.json and, with --write-doc, the "multi_gpu" section of docs/gpu-e2e.md.

    python bench/multi_gpu.py --out mg --write-doc        # on a box with two (or more) GPUs
    python bench/multi_gpu.py --cpu --jobs 4 --out mg     # CPU jobs on two simulated GPU slots, anywhere

With --cpu the service runs with FERRY_DEVICES=0,1 whether or not there is a GPU: the same slots, claims and
CUDA_VISIBLE_DEVICES pinning, with the training on the CPU. The nvidia-smi checks are skipped, and nothing is
written into docs.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata
import json
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import doc_sections
import httpx
import local_server
from gpu_e2e import DOC, DOC_TITLE, fetch_all, spec_from, write_corpus
from multi_gpu_checks import GIB, SlotChange, attach_smi, verdicts
from provenance import commit

ENDED = ("succeeded", "failed", "cancelled", "paused")


def nvidia_smi(query: str, fields: str) -> list[list[str]]:
    """The rows of ``nvidia-smi --query-<query>=<fields>`` as stripped strings, without units."""
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [[part.strip() for part in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def _mib(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:  # "[N/A]", as some drivers print for a process's memory
        return None


def sample_gpus() -> dict[str, Any]:
    """Every GPU (index, UUID, memory used) and every compute process with the index of its GPU."""
    gpus = [
        {"index": i, "uuid": u, "name": n, "used_mib": _mib(m)}
        for i, u, n, m in nvidia_smi("gpu", "index,uuid,name,memory.used")
    ]
    index_of = {gpu["uuid"]: gpu["index"] for gpu in gpus}
    apps = [
        {"pid": int(pid), "gpu": index_of.get(uuid), "used_mib": _mib(used)}
        for pid, uuid, used in nvidia_smi("compute-apps", "pid,gpu_uuid,used_memory")
    ]
    return {"gpus": gpus, "apps": apps}


def config_for(cpu: bool) -> str:
    """The benchmark's job (the 1.8B LoRA LM with model offload), or its tiny CPU twin."""
    return "transformer_lm_lora_cpu.yaml" if cpu else "transformer_lm_lora_model-offload.yaml"


def job_specs(cpu: bool, count: int, steps: int) -> list[str]:
    """``count`` copies of the config, ``steps`` long, reading the corpus written under the data root."""
    return [
        spec_from(
            config_for(cpu), name=f"multi-gpu-{n}", training={"steps": steps, "epochs": None}, data={"path": "corpus"}
        )
        for n in range(count)
    ]


def watch(client: httpx.Client, ids: list[str], *, interval: float, timeout: float, smi: bool) -> list[dict]:
    """Sample the workers, the jobs and (with ``smi``) nvidia-smi every ``interval`` s until all jobs end."""
    samples: list[dict] = []
    start = time.monotonic()
    while True:
        began = time.monotonic()
        workers = client.get("/v1/workers").json()["data"]
        jobs = [client.get(f"/v1/jobs/{job_id}").json() for job_id in ids]
        sample = {
            "t": round(began - start, 2),
            "workers": {w["id"]: {"job": w["job_id"], "pid": w["pid"]} for w in workers},
            "jobs": {
                j["id"]: {"status": j["status"], "worker": j["worker"], "device": j["device"], **(j["memory"] or {})}
                for j in jobs
            },
        }
        samples.append({**sample, **(sample_gpus() if smi else {})})
        if all(job["status"] in ENDED for job in jobs):
            return samples
        if began - start > timeout:
            raise SystemExit(f"jobs still running after {timeout:.0f} s: {[j['status'] for j in jobs]}")
        time.sleep(max(0.0, interval - (time.monotonic() - began)))


def read_job(client: httpx.Client, job_id: str, posted: float) -> dict[str, Any]:
    """The job's record, its slot changes, the pid and CUDA_VISIBLE_DEVICES its log names, its memory series."""
    job = client.get(f"/v1/jobs/{job_id}").json()
    events = fetch_all(client, f"/v1/jobs/{job_id}/events")
    metrics = fetch_all(client, f"/v1/jobs/{job_id}/metrics")
    log = client.get(f"/v1/jobs/{job_id}/logs").text
    launches = re.findall(r"starting in pid (\d+) with CUDA_VISIBLE_DEVICES='([^']*)'", log)
    changes = []
    for event in events:
        data = event["data"]
        if event["type"] == "status" and "running" in (data["status"], data["previous"]):
            at = datetime.datetime.fromisoformat(event["created_at"]).timestamp()
            kind = "start" if data["status"] == "running" else "end"
            changes.append(SlotChange(event["id"], at, kind, job_id, job["worker"]))
    starts = [c.at for c in changes if c.kind == "start"]
    ends = [c.at for c in changes if c.kind == "end"]
    return {
        "id": job_id,
        "name": job["name"],
        "status": job["status"],
        "error": job["error"],
        "attempt": job["attempt"],
        "worker": job["worker"],
        "device": job["device"],
        "pid": int(launches[-1][0]) if launches else None,
        "cuda_visible_devices": [v for _, v in launches],
        "seen_device": next((e["data"].get("device") for e in events if e["type"] == "started"), None),
        "steps": len(metrics),
        "changes": changes,
        "waited_s": starts[0] - posted if starts else None,
        "ran_s": ends[-1] - starts[0] if starts and ends else None,
        "peak_bytes": max((m.get("device_peak_bytes") or 0 for m in metrics), default=0),
        "reserved_bytes": max((m.get("device_reserved_bytes") or 0 for m in metrics), default=0),
        "pinned_bytes": max((m.get("pinned_bytes") or 0 for m in metrics), default=0),
    }


def assignment_rows(samples: list[dict], names: dict[str, str]) -> list[str]:
    """GET /v1/workers over time: a row each time the jobs on the workers changed."""
    workers = list(samples[0]["workers"]) if samples else []
    rows = [f"| t (s) | {' | '.join(workers)} |", "|---" * (len(workers) + 1) + "|"]
    last = None
    for s in samples:
        cells = tuple(names.get(s["workers"][w]["job"], "idle") for w in workers)
        if cells != last:
            rows.append(f"| {s['t']:.1f} | {' | '.join(cells)} |")
            last = cells
    return rows


def markdown(record: dict[str, Any]) -> str:
    """The doc section: when and on what, the per-job table, the assignment over time, the verdicts."""
    gib = lambda v: "—" if not v else f"{v / GIB:.2f}"  # noqa: E731
    secs = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    rows = [
        "| job | worker | pid | POST → start (s) | ran (s) | status | GPU peak, job (GiB) "
        "| GPU reserved, job (GiB) | nvidia-smi, its pid (GiB) | GPUs its pid was on | pinned host (GiB) |",
        "|---" * 11 + "|",
    ]
    for j in record["jobs"]:
        rows.append(
            f"| {j['name']} | {j['worker']} | {j['pid']} | {secs(j['waited_s'])} | {secs(j['ran_s'])} "
            f"| {j['status']} | {gib(j['peak_bytes'])} | {gib(j['reserved_bytes'])} "
            f"| {gib(j.get('smi_bytes'))} | {', '.join(j.get('smi_gpus') or []) or '—'} "
            f"| {gib(j['pinned_bytes'])} |"
        )
    names = {j["id"]: j["name"] for j in record["jobs"]}
    marks = {True: "PASS", False: "FAIL", None: "n/a"}
    lines = [f"- **{marks[ok]}** {name}: {detail}" for name, (ok, detail) in record["verdicts"].items()]
    return (
        f"## One job per GPU: {len(record['jobs'])} LoRA jobs with model offload on {record['slots']} GPUs\n\n"
        f"{record['when']} — {record['gpus']} — torch {record['torch']} — commit {record['commit']}\n\n"
        f"Reproduce: `{record['command']}`\n\n{record['spec_note']}\n\n"
        + "\n".join(rows)
        + "\n\nThe assignment as GET /v1/workers showed it, a row each time it changed:\n\n"
        + "\n".join(assignment_rows(record["samples"], names))
        + "\n\n"
        + "\n".join(lines)
        + "\n"
    )


def run(args: argparse.Namespace, root: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """Start the service, POST every job at once and watch them to the end: (workers, jobs, samples)."""
    write_corpus(root / "datasets" / "corpus")
    (root / "models").mkdir()
    token = secrets.token_hex(16)
    process, url = local_server.start_server(
        root,
        {
            "FERRY_API_TOKEN": token,
            "FERRY_DATA_DIR": str(root / "data"),
            "FERRY_MODEL_ROOTS": str(root / "models"),
            "FERRY_DATA_ROOTS": str(root / "datasets"),
            "FERRY_DEVICES": "0,1" if args.cpu else args.devices,
        },
    )
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
            workers = client.get("/v1/workers").json()["data"]
            posted = {}
            for spec in job_specs(args.cpu, args.jobs, args.steps):
                at = time.time()
                response = client.post("/v1/jobs", content=spec, headers={"Content-Type": "application/yaml"})
                response.raise_for_status()
                posted[response.json()["id"]] = at
            samples = watch(
                client,
                list(posted),
                interval=args.interval or (0.25 if args.cpu else 1.0),
                timeout=args.timeout,
                smi=not args.cpu,
            )
            jobs = [read_job(client, job_id, at) for job_id, at in posted.items()]
    finally:
        process.terminate()
        process.wait(timeout=60)
        (args.out / "server.log").write_bytes((root / "server.log").read_bytes())
    attach_smi(jobs, samples)
    return workers, jobs, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU jobs on simulated GPU slots FERRY_DEVICES=0,1")
    parser.add_argument("--jobs", type=int, default=4, help="how many jobs to submit at once")
    parser.add_argument("--steps", type=int, default=20, help="training.steps of each job")
    parser.add_argument("--devices", default="auto", help="FERRY_DEVICES for the GPU run (--cpu uses 0,1)")
    parser.add_argument("--interval", type=float, help="seconds between samples (default 1; 0.25 with --cpu)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for all jobs together")
    parser.add_argument("--out", type=Path, required=True, help="folder for multi_gpu.json and the server log")
    parser.add_argument("--write-doc", action="store_true", help="replace the multi_gpu section of docs/gpu-e2e.md")
    args = parser.parse_args()
    if args.write_doc and args.cpu:
        parser.error("--write-doc records a GPU run; a --cpu run writes nothing into docs")
    if not args.cpu and shutil.which("nvidia-smi") is None:
        parser.error("nvidia-smi is not on PATH; on a machine without GPUs run with --cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    workers, jobs, samples = run(args, Path(tempfile.mkdtemp(prefix="ferry-multi-gpu-")))
    names = collections.Counter(w["gpu_name"] for w in workers if w["gpu_name"])
    record = {
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpus": ", ".join(f"{n} × {name}" for name, n in names.items()) or "CPU (simulated GPU slots 0,1)",
        "torch": importlib.metadata.version("torch"),
        "commit": commit(),
        "slots": len(workers),
        "command": (
            f"python bench/multi_gpu.py {'--cpu ' if args.cpu else ''}--jobs {args.jobs} --steps {args.steps} "
            f"--out mg{'' if args.cpu else ' --write-doc'}"
        ),
        "spec_note": (
            f"Each job: configs/{config_for(args.cpu)} with training.steps = {args.steps} and "
            f"data.path = corpus; all {args.jobs} POSTed at once."
        ),
        "verdicts": verdicts(jobs, samples, workers, smi=not args.cpu),
        "jobs": [{**j, "changes": [c._asdict() for c in j["changes"]]} for j in jobs],
        "samples": samples,
    }
    (args.out / "multi_gpu.json").write_text(json.dumps(record, indent=2, default=str))
    text = markdown(record)
    print(text)
    if args.write_doc:
        doc_sections.replace_section(DOC, "multi_gpu", text, title=DOC_TITLE)
    if any(ok is False for ok, _ in record["verdicts"].values()):
        raise SystemExit("some checks failed; see above")


if __name__ == "__main__":
    main()
