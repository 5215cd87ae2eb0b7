"""Per-step measurements for progress reports: throughput, time, device and host memory."""

from __future__ import annotations

import os
import time

import psutil
import torch

from jobs.events import DeviceInfo, StepEvent
from offload import OffloadStats


class StepClock:
    """Elapsed time and an ETA from the average step time of this run."""

    def __init__(self, start_step: int, total_steps: int) -> None:
        self.start_step, self.total_steps = start_step, total_steps
        self.started = self.last = time.perf_counter()

    def tick(self, step: int) -> dict[str, float]:
        """Call after step ``step`` has finished (after its loss was read, i.e. after a device sync)."""
        now = time.perf_counter()
        step_seconds, self.last = now - self.last, now
        elapsed = now - self.started
        per_step = elapsed / max(1, step - self.start_step)
        return {"step_s": step_seconds, "elapsed_s": elapsed, "eta_s": per_step * (self.total_steps - step)}


def device_identity(device: torch.device) -> DeviceInfo:
    """Which device this process trains on, as the job itself sees it (the ``started`` event's ``device``).

    ``visible_devices`` and ``uuid`` let a service check that a job saw only the GPU it was given: the
    UUID is the one ``nvidia-smi --query-gpu=uuid`` prints for that GPU.
    """
    if device.type != "cuda":
        return DeviceInfo(type=device.type)
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    return DeviceInfo(
        type="cuda",
        name=props.name,
        uuid=f"GPU-{uuid}" if uuid and not uuid.startswith("GPU-") else uuid,
        visible_devices=torch.cuda.device_count(),
        memory_total_bytes=props.total_memory,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def memory_snapshot(device: torch.device) -> dict[str, int]:
    """Device memory as PyTorch's allocator sees it (0 on the CPU) and this process's resident set size."""
    on_cuda = device.type == "cuda"
    return {
        "device_allocated_bytes": torch.cuda.memory_allocated(device) if on_cuda else 0,
        "device_reserved_bytes": torch.cuda.memory_reserved(device) if on_cuda else 0,
        "device_peak_bytes": torch.cuda.max_memory_allocated(device) if on_cuda else 0,
        "device_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if on_cuda else 0,
        "host_rss_bytes": psutil.Process().memory_info().rss,
    }


def step_event(
    *,
    step: int,
    total_steps: int,
    loss: float,
    lr: float,
    samples: int,
    tokens: int | None,
    timing: dict[str, float],
    device: torch.device,
    offload: OffloadStats | None,
) -> StepEvent:
    """The ``step`` event (jobs/events.py)."""
    seconds = max(timing["step_s"], 1e-9)
    return StepEvent(
        step=step,
        total_steps=total_steps,
        loss=loss,
        lr=lr,
        samples_per_s=samples / seconds,
        tokens_per_s=tokens / seconds if tokens is not None else None,
        elapsed_s=timing["elapsed_s"],
        eta_s=timing["eta_s"],
        **memory_snapshot(device),
        pinned_bytes=int(offload.pinned_reserved_bytes) if offload else 0,
        offload=offload,
    )


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports ``ru_maxrss`` in KiB). Pinned host memory
    is resident, so the offload engine's arena counts in it."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
