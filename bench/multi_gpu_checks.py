"""The verdicts of bench/multi_gpu.py, from what the run saw: the server's events, GET /v1/workers samples,
the jobs' logs and memory series, and nvidia-smi's processes.

Each check is True (pass), False (fail) or None (not checkable on this machine), with what was seen.
"""

from __future__ import annotations

from typing import NamedTuple

GIB, MIB = 2**30, 2**20
# A freed GPU gets the next queued job on the scheduler's next tick (0.2 s); this bound only has to tell
# "as the GPU freed" from "much later".
REFILL_S = 10.0
# nvidia-smi counts a process's CUDA context and library workspaces on top of what torch's allocator reserves.
CONTEXT_SLACK = 2 * GIB

Verdict = tuple[bool | None, str]


class SlotChange(NamedTuple):
    event_id: int  # one autoincrement over all jobs, written with the status change: the server's order
    at: float
    kind: str  # "start" (queued -> running) or "end" (running -> anything)
    job_id: str
    worker: str


def attach_smi(jobs: list[dict], samples: list[dict]) -> None:
    """Per job: the GPUs nvidia-smi ever showed its pid on, and the most memory it showed for it."""
    for job in jobs:
        apps = [app for s in samples for app in s.get("apps", []) if app["pid"] == job["pid"]]
        job["smi_gpus"] = sorted({app["gpu"] for app in apps})
        job["smi_bytes"] = max((app["used_mib"] or 0 for app in apps), default=0) * MIB or None


def verdicts(jobs: list[dict], samples: list[dict], workers: list[dict], smi: bool) -> dict[str, Verdict]:
    """Every check of the run (``workers`` as GET /v1/workers listed them); the nvidia-smi ones with ``smi``."""
    changes = sorted(c for job in jobs for c in job["changes"])
    expected = min(len(jobs), len(workers))
    gpu_of = {w["id"]: w["device"] for w in workers}
    most, shared = sweep(changes, gpu_of)
    most_shown = max((sum(bool(v["job"]) for v in s["workers"].values()) for s in samples), default=0)
    checks = {
        "concurrency": (
            most == expected,
            f"at most {most} running at once by the server's events ({most_shown} "
            f"in one GET /v1/workers sample); expected min({len(jobs)} jobs, "
            f"{len(workers)} GPUs) = {expected}",
        ),
        "one_job_per_gpu": sharing_verdict(shared, jobs, samples, gpu_of),
        "queue": queue_verdict(changes, [job["id"] for job in jobs], expected),
        "pinned": pinned_verdict(jobs, samples),
        "all_succeeded": (
            all(j["status"] == "succeeded" and j["attempt"] == 1 for j in jobs),
            ", ".join(f"{j['name']} {j['status']} (attempt {j['attempt']})" for j in jobs),
        ),
    }
    if smi:
        checks["nvidia_smi_pids"] = pid_verdict(jobs, samples)
        checks["memory_agrees"] = memory_verdict(jobs)
    return checks


def sharing_verdict(shared: list[str], jobs: list[dict], samples: list[dict], gpu_of: dict[str, str]) -> Verdict:
    """No GPU held two jobs at once (``shared``: what the sweep found), no two workers name one GPU, and
    GET /v1/workers showed each job only on the worker (and GPU) its record names."""
    found = list(shared)
    if len(set(gpu_of.values())) < len(gpu_of):
        found.append(f"two workers share a GPU: {gpu_of}")
    found += [
        f"{j['name']} ran on {j['worker']} (GPU {gpu_of.get(j['worker'])}) but its record says GPU {j['device']}"
        for j in jobs
        if j["device"] != gpu_of.get(j["worker"])
    ]
    worker_of = {job["id"]: job["worker"] for job in jobs}
    shown = {(w, seen["job"]) for s in samples for w, seen in s["workers"].items() if seen["job"]}
    found += [
        f"GET /v1/workers showed {j} on {w}, its record says {worker_of.get(j)}"
        for w, j in sorted(shown)
        if worker_of.get(j) != w
    ]
    return not found, "; ".join(found) or "no GPU ever held two jobs; every job was shown on its own worker only"


def sweep(changes: list[SlotChange], gpu_of: dict[str, str]) -> tuple[int, list[str]]:
    """Replay the slot changes in the server's order: the most jobs running at once, and any start on a
    GPU that already had a job."""
    busy: dict[str, str] = {}  # GPU index -> job
    most, shared = 0, []
    for change in changes:
        gpu = gpu_of.get(change.worker, change.worker)
        if change.kind == "start":
            if gpu in busy:
                shared.append(f"{change.job_id} started on GPU {gpu} ({change.worker}) while {busy[gpu]} ran there")
            busy[gpu] = change.job_id
            most = max(most, len(busy))
        else:
            busy.pop(gpu, None)
    return most, shared


def queue_verdict(changes: list[SlotChange], ids: list[str], expected: int) -> Verdict:
    """Oldest first; the first ``expected`` start together, each later one soon after a GPU freed."""
    starts = [(n, c) for n, c in enumerate(changes) if c.kind == "start"]
    in_order = [c.job_id for _, c in starts] == ids
    at_once = [c.kind for c in changes[:expected]] == ["start"] * expected
    waits = []
    for n, start in starts[expected:]:
        freed = [c.at for c in changes[:n] if c.kind == "end"]
        waits.append(start.at - freed[-1] if freed else float("inf"))
    ok = in_order and at_once and all(w < REFILL_S for w in waits)
    return ok, (
        f"started oldest first: {in_order}; the first {expected} at once: {at_once}; each later one "
        f"started {', '.join(f'{w:.2f}' for w in waits) or '-'} s after a GPU freed"
    )


def pinned_verdict(jobs: list[dict], samples: list[dict]) -> Verdict:
    """Each job's log names its worker's index and the pid /v1/workers showed; a CUDA job saw one GPU, its own."""
    uuid_of = {gpu["index"]: gpu["uuid"] for s in samples[:1] for gpu in s.get("gpus", [])}
    pids = {seen["job"]: seen["pid"] for s in samples for seen in s["workers"].values() if seen["job"]}
    wrong = []
    for job in jobs:
        if job["cuda_visible_devices"] != [job["device"]]:
            wrong.append(f"{job['name']} on {job['worker']} logged CUDA_VISIBLE_DEVICES={job['cuda_visible_devices']}")
        if pids.get(job["id"], job["pid"]) != job["pid"]:
            wrong.append(f"{job['name']}: /v1/workers showed pid {pids[job['id']]}, its log says {job['pid']}")
        seen = job["seen_device"] or {}
        if seen.get("type") == "cuda" and (
            seen.get("visible_devices") != 1 or seen.get("uuid") != uuid_of.get(job["device"], seen.get("uuid"))
        ):
            wrong.append(f"{job['name']} saw {seen.get('visible_devices')} GPU(s), {seen.get('uuid')}")
    checked_uuid = any((j["seen_device"] or {}).get("uuid") for j in jobs) and uuid_of
    return not wrong, "; ".join(wrong) or (
        "each job's process started with CUDA_VISIBLE_DEVICES = its worker's "
        "index, in the pid /v1/workers showed"
        + (", and saw one GPU whose UUID is that index's" if checked_uuid else "")
    )


def pid_verdict(jobs: list[dict], samples: list[dict]) -> Verdict:
    """nvidia-smi showed each job's pid on its assigned GPU and never on another."""
    if not any(job["smi_gpus"] for job in jobs):
        return apps_per_gpu_verdict(samples)
    wrong = [
        f"{j['name']} (pid {j['pid']}, GPU {j['device']}) seen on GPUs {j['smi_gpus']}"
        for j in jobs
        if j["smi_gpus"] != [j["device"]]
    ]
    job_pids = {j["pid"] for j in jobs}
    for s in samples:
        for gpu in {app["gpu"] for app in s.get("apps", [])}:
            together = sorted({a["pid"] for a in s["apps"] if a["gpu"] == gpu and a["pid"] in job_pids})
            if len(together) > 1:
                wrong.append(f"at {s['t']} s nvidia-smi showed job pids {together} together on GPU {gpu}")
    return not wrong, "; ".join(wrong) or (
        "every job's pid was seen by nvidia-smi on its assigned GPU and no other, never two jobs on one GPU"
    )


def apps_per_gpu_verdict(samples: list[dict]) -> Verdict:
    """Without comparable pids (a container with its own PID namespace), at least: never two processes on a GPU."""
    listed = sorted({app["pid"] for s in samples for app in s.get("apps", [])})
    if not listed:
        return None, "nvidia-smi listed no compute process at all (no access to other processes?)"
    crowded = [
        f"{s['t']} s: GPU {gpu}"
        for s in samples
        for gpu in {a["gpu"] for a in s["apps"]}
        if sum(a["gpu"] == gpu for a in s["apps"]) > 1
    ]
    return not crowded, (
        f"nvidia-smi never showed a job's pid (it listed {listed}: another PID namespace); "
        + (
            f"two processes on one GPU at {', '.join(crowded)}"
            if crowded
            else "it never showed two processes on one GPU"
        )
    )


def memory_verdict(jobs: list[dict]) -> Verdict:
    """nvidia-smi's most for the pid lies between the job's peak allocation and its reserve plus a context.

    Both ends hold once one sample falls after the job's first step: from then on its reserve stays at or
    above its peak (the caching allocator keeps what it took until the job ends), and nvidia-smi sees the
    reserve plus the context.
    """
    measured = [j for j in jobs if j["smi_bytes"]]
    if not measured:
        return None, "nvidia-smi gave no per-process memory"
    ok = all(j["peak_bytes"] <= j["smi_bytes"] <= j["reserved_bytes"] + CONTEXT_SLACK for j in measured)
    return ok, (
        "nvidia-smi for the pid minus the job's own peak / reserved: "
        + ", ".join(
            f"{j['name']} {(j['smi_bytes'] - j['peak_bytes']) / GIB:+.2f} / "
            f"{(j['smi_bytes'] - j['reserved_bytes']) / GIB:+.2f} GiB"
            for j in measured
        )
        + f" (agree: at least 0 over the peak, at most {CONTEXT_SLACK / GIB:.0f} GiB over the reserve)"
    )
