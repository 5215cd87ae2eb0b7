"""Can this machine run the job? The device and host-memory checks that the service runs at submit and
``python -m jobs validate`` / ``run`` run before any work, with the same messages.

Each check returns a problem (the spec path it concerns and what is wrong, with the fix) or None; the
caller decides how to refuse: the service with a 422, the command line with exit code 2.

Example:
    >>> device_problem(spec, has_gpu=False)
    ('device', 'device: cuda, but no CUDA device is available here; set device: cpu or auto, or run it on a machine with a GPU')
"""

from __future__ import annotations

from jobs.errors import Problem
from jobs.fit.estimate import human_bytes
from jobs.spec.job import JobSpec

GIB = 2**30


def device_problem(
    spec: JobSpec,
    *,
    has_gpu: bool,
    where: str = "no CUDA device is available here",
    elsewhere: str = "run it on a machine with a GPU",
) -> Problem | None:
    """``device: cuda`` where no GPU is: the job would wait for ever, or fail as it starts."""
    if spec.device != "cuda" or has_gpu:
        return None
    return "device", f"device: cuda, but {where}; set device: cpu or auto, or {elsewhere}"


def host_memory_problem(
    *, peak_device_bytes: int, pinned_host_bytes: int, host_total_bytes: int, on_host: bool
) -> Problem | None:
    """More host memory than the machine has: the whole peak of a job on the CPU (``on_host``), the pinned
    copies always (page-locked memory cannot be swapped out). The figures come from `estimate_memory`."""
    needed = pinned_host_bytes + (peak_device_bytes if on_host else 0)
    if needed <= host_total_bytes:
        return None
    if on_host:
        message = (
            f"the job needs an estimated {human_bytes(needed)} of host memory (peak {human_bytes(peak_device_bytes)}"
            f" + pinned copies {human_bytes(pinned_host_bytes)}) but this machine has {human_bytes(host_total_bytes)}"
        )
    else:
        message = (
            f"the offload engine's pinned host copies need {pinned_host_bytes / GIB:.1f} GiB but this machine "
            f"has {host_total_bytes / GIB:.1f} GiB of memory"
        )
    return "model", message
