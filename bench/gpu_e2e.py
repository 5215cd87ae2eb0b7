"""The whole product through HTTP only, as on a GPU box: start the service as the image's entrypoint does,
submit jobs, follow them to the end, read their figures, download and verify a checkpoint, and see the fit
check refuse a job that cannot fit without offload. Writes a JSON transcript and, with --write-doc,
docs/gpu-e2e.md.

    python bench/gpu_e2e.py --out /tmp/e2e                    # on the GPU box (the H200)
    python bench/gpu_e2e.py --cpu --out /tmp/e2e               # the same path with CPU jobs, anywhere

The only difference from the container: the server binds 127.0.0.1 (the image binds 0.0.0.0 with a token).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import secrets
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import local_server
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
GIB = 2**30


def start_server(root: Path, token: str) -> tuple[subprocess.Popen, str]:
    """``python -m service`` with the image's settings (data dir, roots, token), on a free loopback port."""
    return local_server.start_server(root, {"FERRY_API_TOKEN": token, "FERRY_DATA_DIR": str(root / "data"),
                                            "FERRY_MODEL_ROOTS": str(root / "models"),
                                            "FERRY_DATA_ROOTS": str(root / "datasets")})


def spec_from(config: str, **changes: Any) -> str:
    """A config from configs/ with sections updated (``training={"steps": 20}``)."""
    data = yaml.safe_load((CONFIGS / config).read_text())
    for section, values in changes.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return yaml.safe_dump(data, sort_keys=False)


def fetch_all(client: httpx.Client, path: str) -> list[dict[str, Any]]:
    """Every item of a cursor-paginated series (events, metrics), following ``next_cursor``."""
    items: list[dict[str, Any]] = []
    after = 0
    while True:
        page = client.get(path, params={"after": after, "limit": 1000}).json()
        items += page["data"]
        if not page["has_more"]:
            return items
        after = page["next_cursor"]


def run_job(client: httpx.Client, label: str, spec: str, timeout: float) -> dict[str, Any]:
    """POST ``spec`` and follow it to the end; the figures a user reads over REST."""
    posted = time.time()
    response = client.post("/v1/jobs", content=spec, headers={"Content-Type": "application/yaml"})
    response.raise_for_status()
    job_id = response.json()["id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(1)
    else:
        raise SystemExit(f"{label}: still {job['status']} after {timeout:.0f} s")
    events = fetch_all(client, f"/v1/jobs/{job_id}/events")
    steps = [e for e in events if e["type"] == "step"]
    metrics = fetch_all(client, f"/v1/jobs/{job_id}/metrics")
    elapsed = [m.get("elapsed_s") for m in metrics if m.get("elapsed_s") is not None]
    step_times = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)][1:]  # without the first (warm-up) step
    first_step = datetime.datetime.fromisoformat(steps[0]["created_at"]).timestamp() - posted if steps else None
    memory = job.get("memory") or {}
    return {
        "label": label, "id": job_id, "status": job["status"], "error": job.get("error"),
        "steps": len(steps), "post_to_first_step_s": first_step,
        "median_step_s": statistics.median(step_times) if step_times else None,
        "device_peak_gib": (memory.get("device_peak_bytes") or 0) / GIB,
        "pinned_gib": (memory.get("pinned_bytes") or 0) / GIB,
        "offload": job.get("offload"),
    }


def verify_a_checkpoint(client: httpx.Client, job_id: str) -> dict[str, Any]:
    """Download the largest file of the last checkpoint and compare its SHA-256 with the listing's."""
    checkpoint = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"][-1]
    file = max(checkpoint["files"], key=lambda f: f["bytes"])
    digest = hashlib.sha256()
    with client.stream("GET", file["url"]) as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            digest.update(chunk)
    return {"checkpoint": checkpoint["name"], "file": file["name"], "bytes": file["bytes"],
            "sha256_listed": file["sha256"], "sha256_downloaded": digest.hexdigest(),
            "matches": digest.hexdigest() == file["sha256"]}


def plan(cpu: bool) -> tuple[list[tuple[str, str]], str]:
    """The jobs to run and the spec the fit check must refuse."""
    if cpu:
        jobs = [("toy, no offload", spec_from("cpu_smoke.yaml", offload={"enable_model_cpu_offload": False,
                                                                          "enable_optimizer_cpu_offload": False})),
                ("toy, model + optimizer offload", spec_from("cpu_smoke.yaml")),
                ("LoRA LM, model offload", spec_from("transformer_lm_lora_cpu.yaml",
                                                     data={"path": "corpus"}))]
    else:
        short = {"steps": 30, "scheduler": {"kind": "constant", "warmup_steps": 0}}
        jobs = [("seed toy, no offload", spec_from("toy_mlp_full_no-offload.yaml", training=short)),
                ("seed toy, model + optimizer offload", spec_from("toy_mlp_full_optimizer-offload.yaml",
                                                                  training=short)),
                ("6.7B LoRA, model offload", spec_from("transformer_lm-7b_lora_model-offload.yaml",
                                                       training={"steps": 10}, data={"path": "corpus"}))]
    # About 72B parameters in bf16 (145 GB): more than an H200 holds, so without offload it cannot fit.
    too_big = spec_from("transformer_lm-7b_lora_model-offload.yaml", name="too-big-without-offload",
                        model={"hidden_size": 8192, "num_layers": 90, "num_heads": 64,
                               "intermediate_size": 32768},
                        data={"path": "corpus"}, offload={"enable_model_cpu_offload": False,
                                                          "granularity": "leaf"})
    return jobs, too_big


def write_corpus(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = (CONFIGS / "data" / "tiny_corpus.txt").read_text()
    (directory / "corpus.txt").write_text(text * 400)


def markdown(record: dict[str, Any]) -> str:
    rows = ["| job | status | steps | POST → first step (s) | median step (s) | peak GPU (GiB) | pinned host (GiB) |",
            "|---|---|---|---|---|---|---|"]
    for job in record["jobs"]:
        fmt = lambda v, spec=".2f": "—" if v is None else format(v, spec)  # noqa: E731
        rows.append(f"| {job['label']} | {job['status']} | {job['steps']} | {fmt(job['post_to_first_step_s'], '.1f')} "
                    f"| {fmt(job['median_step_s'], '.3f')} | {job['device_peak_gib']:.2f} | {job['pinned_gib']:.2f} |")
    check = record["checkpoint"]
    fit = record["fit_check"]
    return (f"# End-to-end run on a GPU\n\n{record['when']} — {record['device']} — torch {record['torch']} — "
            f"commit {record['commit']}\n\nReproduce: `python bench/gpu_e2e.py --out /tmp/e2e --write-doc`\n\n"
            + "\n".join(rows) +
            f"\n\nCheckpoint download: `{check['file']}` of {check['checkpoint']} ({check['bytes']} bytes), "
            f"SHA-256 {'matches' if check['matches'] else 'DOES NOT match'} the listing.\n\n"
            f"Fit check for a {fit['name']} spec: fits = {fit['fits']}, estimated peak "
            f"{fit['peak_gib']:.1f} GiB against {fit['largest_device_gib']} GiB on the largest device.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU jobs (check the path on a machine without a GPU)")
    parser.add_argument("--out", type=Path, required=True, help="folder for e2e.json and the server log")
    parser.add_argument("--write-doc", action="store_true", help="write docs/gpu-e2e.md")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ferry-e2e-"))
    write_corpus(root / "datasets" / "corpus")
    (root / "models").mkdir()
    token = secrets.token_hex(16)
    process, url = start_server(root, token)
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
            jobs, too_big = plan(args.cpu)
            results = [run_job(client, label, spec, args.timeout) for label, spec in jobs]
            for result in results:
                print(json.dumps(result), flush=True)
            verified = verify_a_checkpoint(client, results[-1]["id"])
            validation = client.post("/v1/jobs/validate", content=too_big,
                                     headers={"Content-Type": "application/yaml"}).json()
            estimate = validation.get("estimate") or {}
            sizes = [d.get("memory_total_bytes") or 0 for d in estimate.get("devices", [])]
            workers = client.get("/v1/workers").json()["data"]
    finally:
        process.terminate()
        process.wait(timeout=60)
    import torch

    record = {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip() or "unknown",
        "jobs": results, "checkpoint": verified, "workers": workers,
        "fit_check": {"name": "72B-parameter bf16 LoRA without offload", "fits": estimate.get("fits"),
                      "peak_gib": estimate.get("peak_device_bytes", 0) / GIB,
                      "largest_device_gib": round(max(sizes, default=0) / GIB, 1), "notes": estimate.get("notes")},
    }
    (args.out / "e2e.json").write_text(json.dumps(record, indent=2, default=str))
    (args.out / "server.log").write_bytes((root / "server.log").read_bytes())
    text = markdown(record)
    print(text)
    if args.write_doc:
        (REPO / "docs" / "gpu-e2e.md").write_text(text)


if __name__ == "__main__":
    main()
