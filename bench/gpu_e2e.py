"""The whole product through HTTP only, as on a GPU box: start the service as the image's entrypoint does,
submit jobs, follow them to the end, read their figures, download and verify a checkpoint, and see the fit
check refuse a job that cannot fit without offload. Writes a JSON transcript and, with --write-doc, its
section of docs/gpu-e2e.md (``single_gpu``, or ``ray`` with ``--executor ray``).

    python bench/gpu_e2e.py --out e2e --write-doc                   # on the GPU box (the H200)
    python bench/gpu_e2e.py --executor ray --out e2e-ray --write-doc  # through a one-node Ray cluster
    python bench/gpu_e2e.py --cpu --out e2e                         # the same path with CPU jobs, anywhere

The only difference from the container: the server binds 127.0.0.1 (the image binds 0.0.0.0 with a token).
With ``--executor ray`` the script first starts a Ray head on this machine (``ray start --head``) and
points the service at it (``FERRY_EXECUTOR=ray``, ``FERRY_RAY_ADDRESS``, ``FERRY_SHARED_DIR``), as
the README's two-node layout does on its head node; it stops that head at the end.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import local_server
import yaml
from doc_sections import replace_section
from provenance import commit

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
GIB = 2**30


DOC = REPO / "docs" / "gpu-e2e.md"
DOC_TITLE = "End-to-end runs on GPUs"


def start_server(root: Path, token: str, extra: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """``python -m service`` with the image's settings (data dir, roots, token), on a free loopback port."""
    return local_server.start_server(
        root,
        {
            "FERRY_API_TOKEN": token,
            "FERRY_DATA_DIR": str(root / "data"),
            "FERRY_MODEL_ROOTS": str(root / "models"),
            "FERRY_DATA_ROOTS": str(root / "datasets"),
            **extra,
        },
    )


class RayHead:
    """``ray start --head`` on this machine, its workers able to import Ferry; ``stop()`` ends it.

    The service then joins it with ``FERRY_RAY_ADDRESS=auto``, as on the README's head node. (Another Ray
    user on this machine would find this head too: don't run it beside the Ray tests.)
    """

    def __init__(self, root: Path, cpus: int | None) -> None:
        # Ray's workers inherit the raylet's environment, so they import `service` and `jobs` as the server does.
        self._env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        }
        command = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--include-dashboard=false",
            "--object-store-memory=1000000000",
            "--disable-usage-stats",
        ]
        if cpus is not None:
            command.append(f"--num-cpus={cpus}")
        started = time.monotonic()
        result = subprocess.run(command, env=self._env, capture_output=True, text=True, timeout=180)
        (root / "ray-start.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise SystemExit(f"ray start failed:\n{result.stderr[-3000:]}")
        self.start_s = time.monotonic() - started
        self.address = "auto"

    def stop(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
            env=self._env,
            capture_output=True,
            timeout=120,
        )


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
    worker_seen = None  # GET /v1/workers while the job runs: its worker, GPU and process
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        if worker_seen is None and job["status"] == "running" and job.get("progress"):
            worker_seen = next((w for w in client.get("/v1/workers").json()["data"] if w["job_id"] == job_id), None)
        time.sleep(1)
    else:
        raise SystemExit(f"{label}: still {job['status']} after {timeout:.0f} s")
    events = fetch_all(client, f"/v1/jobs/{job_id}/events")
    steps = [e for e in events if e["type"] == "step"]
    metrics = fetch_all(client, f"/v1/jobs/{job_id}/metrics")
    elapsed = [m.get("elapsed_s") for m in metrics if m.get("elapsed_s") is not None]
    step_times = [b - a for a, b in itertools.pairwise(elapsed)][1:]  # without the first (warm-up) step
    first_step = datetime.datetime.fromisoformat(steps[0]["created_at"]).timestamp() - posted if steps else None
    memory = job.get("memory") or {}
    placed = [
        e["data"]["message"]
        for e in events
        if e["type"] == "log" and "runs on Ray node" in e["data"].get("message", "")
    ]
    seen = next((e["data"].get("device") for e in events if e["type"] == "started"), None)
    return {
        "label": label,
        "id": job_id,
        "status": job["status"],
        "error": job.get("error"),
        "worker": job.get("worker"),
        "worker_while_running": worker_seen,
        "device_seen_by_job": seen,
        "ray_placement": placed,
        "steps": len(steps),
        "post_to_first_step_s": first_step,
        "median_step_s": statistics.median(step_times) if step_times else None,
        "device_peak_gib": (memory.get("device_peak_bytes") or 0) / GIB,
        "pinned_gib": (memory.get("pinned_bytes") or 0) / GIB,
        "offload": job.get("offload"),
    }


def verify_a_checkpoint(client: httpx.Client, job_id: str) -> dict[str, Any]:
    """Download the weights (the largest safetensors file) of the last checkpoint; compare its SHA-256."""
    checkpoint = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"][-1]
    file = max(checkpoint["files"], key=lambda f: (f["name"].endswith(".safetensors"), f["bytes"]))
    digest = hashlib.sha256()
    with client.stream("GET", file["url"]) as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            digest.update(chunk)
    return {
        "checkpoint": checkpoint["name"],
        "file": file["name"],
        "bytes": file["bytes"],
        "sha256_listed": file["sha256"],
        "sha256_downloaded": digest.hexdigest(),
        "matches": digest.hexdigest() == file["sha256"],
    }


NO_OFFLOAD = {"enable_model_cpu_offload": False, "enable_optimizer_cpu_offload": False}


def plan(cpu: bool, executor: str) -> tuple[list[tuple[str, str]], str]:
    """The jobs to run (the last one's checkpoint is downloaded) and the spec the fit check must refuse."""
    if executor == "ray":  # one LoRA job with model offload, placed by Ray
        if cpu:
            jobs = [
                ("LoRA LM, model offload, on Ray", spec_from("transformer_lm_lora_cpu.yaml", data={"path": "corpus"}))
            ]
        else:
            jobs = [
                (
                    "1.8B LoRA, model offload, on Ray",
                    spec_from(
                        "transformer_lm_lora_model-offload.yaml",
                        training={"steps": 30, "epochs": None},
                        data={"path": "corpus"},
                        checkpoint={"every_steps": 10, "keep_last": 2},
                    ),
                )
            ]
    elif cpu:
        jobs = [
            ("toy, no offload", spec_from("cpu_smoke.yaml", offload=NO_OFFLOAD)),
            ("toy, model + optimizer offload", spec_from("cpu_smoke.yaml")),
            ("LoRA LM, model offload", spec_from("transformer_lm_lora_cpu.yaml", data={"path": "corpus"})),
        ]
    else:
        short = {"steps": 30, "scheduler": {"kind": "constant", "warmup_steps": 0}}
        lora_7b = {"steps": 10, "scheduler": {"kind": "constant", "warmup_steps": 0}}
        jobs = [
            ("seed toy, no offload", spec_from("toy_mlp_full_no-offload.yaml", training=short)),
            ("seed toy, model + optimizer offload", spec_from("toy_mlp_full_optimizer-offload.yaml", training=short)),
            (
                "6.7B LoRA, no offload",
                spec_from(
                    "transformer_lm-7b_lora_model-offload.yaml",
                    name="transformer-lm-7b-lora-no-offload",
                    training=lora_7b,
                    data={"path": "corpus"},
                    offload={"enable_model_cpu_offload": False},
                ),
            ),
            (
                "6.7B LoRA, model offload",
                spec_from("transformer_lm-7b_lora_model-offload.yaml", training=lora_7b, data={"path": "corpus"}),
            ),
        ]
    # About 72B parameters in bf16 (145 GB): more than an H200 holds, so without offload it cannot fit.
    too_big = spec_from(
        "transformer_lm-7b_lora_model-offload.yaml",
        name="too-big-without-offload",
        model={"hidden_size": 8192, "num_layers": 90, "num_heads": 64, "intermediate_size": 32768},
        data={"path": "corpus"},
        offload={"enable_model_cpu_offload": False, "granularity": "leaf"},
    )
    return jobs, too_big


def write_corpus(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = (CONFIGS / "data" / "tiny_corpus.txt").read_text()
    (directory / "corpus.txt").write_text(text * 400)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def markdown(record: dict[str, Any]) -> str:
    """The section of docs/gpu-e2e.md for this run."""
    ray = record["executor"] == "ray"
    rows = [
        "| job | status | worker (pid while running) | steps | POST → first step (s) | median step (s) "
        "| peak GPU (GiB) | pinned host (GiB) | H2D GB/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for job in record["jobs"]:
        seen = job.get("worker_while_running") or {}
        offload = job.get("offload") or {}
        h2d = offload.get("h2d_bytes") / job["steps"] / 1e9 if offload.get("h2d_bytes") and job["steps"] else None
        rows.append(
            f"| {job['label']} | {job['status']} | {job['worker']} ({seen.get('pid', '—')}) | {job['steps']} "
            f"| {_fmt(job['post_to_first_step_s'], '.2f')} | {_fmt(job['median_step_s'], '.3f')} "
            f"| {job['device_peak_gib']:.2f} | {job['pinned_gib']:.2f} | {_fmt(h2d)} |"
        )
    check = record["checkpoint"]
    command = (
        "python bench/gpu_e2e.py --executor ray --out e2e-ray --write-doc"
        if ray
        else "python bench/gpu_e2e.py --out e2e --write-doc"
    )
    heading = "## Through a one-node Ray cluster" if ray else "## One GPU, the service as the image runs it"
    lines = [
        heading,
        "",
        f"{record['when']} — {record['device']} — torch {record['torch']} — commit {record['commit']}"
        f" — executor `{record['executor']}`",
        "",
        f"Reproduce: `{command}`",
        "",
        *rows,
        "",
        f"Checkpoint download: `{check['file']}` of {check['checkpoint']} ({check['bytes']} bytes), SHA-256 "
        f"{'matches' if check['matches'] else 'DOES NOT match'} the listing.",
    ]
    for job in record["jobs"]:
        seen = job.get("device_seen_by_job") or {}
        if seen.get("type") == "cuda":
            lines.append(
                f"{job['label']}: the job's process saw {seen['visible_devices']} GPU ({seen['name']}, "
                f"`{seen['uuid']}`, CUDA_VISIBLE_DEVICES={seen.get('cuda_visible_devices')!r})."
            )
        for placed in job.get("ray_placement") or []:
            lines.append(f'{job["label"]}: "{placed}" (the job\'s own log event).')
    if ray:
        lines.append(
            f"Ray head started in {record['ray_start_s']:.1f} s (`ray start --head`); the service joined "
            "it with `FERRY_EXECUTOR=ray FERRY_RAY_ADDRESS=auto FERRY_SHARED_DIR=...`."
        )
    fit = record.get("fit_check")
    if fit:
        submit = fit["submit"]
        lines += [
            "",
            f"Fit check for a {fit['name']} spec: `POST /v1/jobs/validate` says fits = {fit['fits']}, "
            f"estimated peak {fit['peak_gib']:.1f} GiB against {fit['largest_device_gib']} GiB on the largest "
            f"device. `POST /v1/jobs`: {submit['status_code']} `{submit['code']}` — {submit['message']}",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU jobs (check the path on a machine without a GPU)")
    parser.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="ray: start a one-node Ray head here and run the job through it",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for e2e.json and the server log")
    parser.add_argument("--write-doc", action="store_true", help="write this run's section of docs/gpu-e2e.md")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ferry-e2e-"))
    write_corpus(root / "datasets" / "corpus")
    (root / "models").mkdir()
    token = secrets.token_hex(16)
    head, extra = None, {}
    if args.executor == "ray":
        head = RayHead(root, cpus=2 if args.cpu else None)
        extra = {
            "FERRY_EXECUTOR": "ray",
            "FERRY_RAY_ADDRESS": head.address,
            "FERRY_SHARED_DIR": str(root / "shared"),
            "FERRY_RAY_CPUS_PER_JOB": "1" if args.cpu else "4",
        }
    try:
        process, url = start_server(root, token, extra)
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
                jobs, too_big = plan(args.cpu, args.executor)
                results = []
                for label, spec in jobs:
                    results.append(run_job(client, label, spec, args.timeout))
                    print(json.dumps(results[-1], default=str), flush=True)
                verified = verify_a_checkpoint(client, results[-1]["id"])
                fit = None if args.executor == "ray" else check_fit(client, too_big, refusal_expected=not args.cpu)
                workers = client.get("/v1/workers").json()["data"]
        finally:
            process.terminate()
            process.wait(timeout=60)
    finally:
        if head is not None:
            head.stop()
    import torch

    record = {
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "commit": commit(),
        "executor": args.executor,
        "ray_start_s": head.start_s if head else None,
        "jobs": results,
        "checkpoint": verified,
        "workers": workers,
        "fit_check": fit,
    }
    (args.out / "e2e.json").write_text(json.dumps(record, indent=2, default=str))
    (args.out / "server.log").write_bytes((root / "server.log").read_bytes())
    text = markdown(record)
    print(text)
    failed = [job["label"] for job in results if job["status"] != "succeeded"]
    if args.write_doc:
        replace_section(DOC, "ray" if args.executor == "ray" else "single_gpu", text, title=DOC_TITLE)
    if failed or not verified["matches"] or (fit and not fit["as_expected"]):
        raise SystemExit(f"not as expected: failed jobs {failed}, checksum {verified['matches']}, fit check {fit}")


def check_fit(client: httpx.Client, too_big: str, *, refusal_expected: bool) -> dict[str, Any]:
    """Validate the spec that cannot fit, then submit it: on a GPU service the submit must be refused."""
    validation = client.post("/v1/jobs/validate", content=too_big, headers={"Content-Type": "application/yaml"}).json()
    estimate = validation.get("estimate") or {}
    sizes = [d.get("memory_total_bytes") or 0 for d in estimate.get("devices", [])]
    submit: dict[str, Any] = {
        "status_code": None,
        "code": "not submitted",
        "message": "CPU workers only: no GPU to refuse it for",
    }
    if refusal_expected:
        response = client.post("/v1/jobs", content=too_big, headers={"Content-Type": "application/yaml"})
        error = response.json().get("error") or {}
        submit = {"status_code": response.status_code, "code": error.get("code"), "message": error.get("message")}
    as_expected = (submit["code"] == "does_not_fit" and estimate.get("fits") is False) if refusal_expected else True
    return {
        "name": "72B-parameter bf16 LoRA without offload",
        "fits": estimate.get("fits"),
        "peak_gib": estimate.get("peak_device_bytes", 0) / GIB,
        "largest_device_gib": round(max(sizes, default=0) / GIB, 1),
        "notes": estimate.get("notes"),
        "submit": submit,
        "as_expected": as_expected,
    }


if __name__ == "__main__":
    main()
