"""Worker slots (one per GPU, or CPU slots when there is none) and what the GPUs hold right now."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.settings import Settings


@dataclass(frozen=True)
class Slot:
    """A place one job runs at a time: a GPU index, or the CPU (``device`` None)."""

    id: str
    device: str | None


@dataclass(frozen=True)
class GpuInfo:
    index: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int


def query_gpus() -> list[GpuInfo]:
    """Ask ``nvidia-smi``, which never initialises CUDA in this process; [] on a machine without it."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        index, name, total, used = (part.strip() for part in line.split(","))
        gpus.append(GpuInfo(index, name, int(float(total)) << 20, int(float(used)) << 20))
    return gpus


def plan_slots(settings: Settings, gpus: list[GpuInfo]) -> list[Slot]:
    """One slot per GPU named in ``settings.devices`` (or every GPU for "auto"); CPU slots when none."""
    spec = settings.devices.strip().lower()
    if spec == "auto":
        indices = [gpu.index for gpu in gpus]
    elif spec == "cpu":
        indices = []
    else:
        indices = [part.strip() for part in spec.split(",") if part.strip()]
    if indices:
        return [Slot(id=f"gpu{index}", device=index) for index in indices]
    return [Slot(id=f"cpu{n}", device=None) for n in range(settings.cpu_workers)]


def unlisted_devices_problem(settings: Settings, gpus: list[GpuInfo]) -> str | None:
    """Why ``FERRY_DEVICES`` cannot be served here: it names a GPU index that ``nvidia-smi`` does not list.

    Only checked when nvidia-smi answered: without it the indices are taken as given (a box whose driver
    tools are elsewhere, or tests that simulate GPUs).
    """
    spec = settings.devices.strip().lower()
    if spec in ("auto", "cpu") or not gpus:
        return None
    listed = [gpu.index for gpu in gpus]
    unknown = [part.strip() for part in spec.split(",") if part.strip() and part.strip() not in listed]
    if not unknown:
        return None
    return (
        f"FERRY_DEVICES={settings.devices!r} names GPU {', '.join(unknown)}, which nvidia-smi does not list "
        f"(it lists {', '.join(listed)}); use those indices, 'auto' for all of them, or 'cpu'"
    )


class GpuMonitor:
    """``query_gpus`` cached for a couple of seconds: /v1/workers and /metrics may be polled hard."""

    def __init__(self, probe: Callable[[], list[GpuInfo]] = query_gpus, ttl_s: float = 2.0) -> None:
        self._probe, self._ttl = probe, ttl_s
        self._at = 0.0
        self._cached: list[GpuInfo] = []

    def gpus(self) -> list[GpuInfo]:
        if time.monotonic() - self._at > self._ttl:
            self._cached, self._at = self._probe(), time.monotonic()
        return self._cached


def cpu_threads_per_job(slots: list[Slot], cpu_count: int | None) -> int:
    """Torch threads for each CPU job: the cores shared by the CPU slots, less one left to the server."""
    cpu_slots = sum(slot.device is None for slot in slots) or 1
    return max(1, ((cpu_count or 2) - 1) // cpu_slots)


def threads_for(slot: Slot, slots: list[Slot], cpu_count: int | None) -> int | None:
    """`cpu_threads_per_job` for a CPU slot; for a GPU slot torch's default (every core) when it is the only slot,
    else the cores shared by all the slots, less one left to the server. A GPU job's host work (a CPU optimizer
    step, a `device: cpu` job placed there) runs on torch's threads: two jobs each with a thread per core waited on
    each other's threads, 100 toy steps taking 15-17 s instead of 0.2 s on 2 cores (tests/service/workers/
    test_multi_gpu_slots.py)."""
    if slot.device is None:
        return cpu_threads_per_job(slots, cpu_count)
    if len(slots) == 1:
        return None
    return max(1, ((cpu_count or 2) - 1) // len(slots))
