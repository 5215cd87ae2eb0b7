"""The dry-run fit check: the spec's memory estimate against this service's GPUs and host memory."""

from __future__ import annotations

import psutil
from jobs import JobSpec, estimate_memory

from .devices import GpuInfo, Slot
from .schemas import DeviceFit, FitEstimate


def estimate_fit(spec: JobSpec, slots: list[Slot], gpus: list[GpuInfo]) -> FitEstimate:
    """Does the job fit every worker it could be given? On CPU workers device and pinned memory are host RAM."""
    estimate = estimate_memory(spec)
    host_free = psutil.virtual_memory().available
    by_index = {gpu.index: gpu for gpu in gpus}
    devices = []
    for slot in slots:
        if slot.device is None:
            total, fits = None, estimate.peak_device_bytes + estimate.pinned_host_bytes <= host_free
        else:
            gpu = by_index.get(slot.device)
            total = gpu.memory_total_bytes if gpu else None
            fits = None if total is None else estimate.peak_device_bytes <= total
        devices.append(DeviceFit(worker=slot.id, device=slot.device, memory_total_bytes=total, fits=fits))
    host_fits = estimate.pinned_host_bytes <= host_free
    verdicts = [d.fits for d in devices]
    fits = None if None in verdicts else (all(verdicts) and host_fits)
    return FitEstimate(
        peak_device_bytes=estimate.peak_device_bytes, pinned_host_bytes=estimate.pinned_host_bytes,
        notes=list(estimate.notes), host_available_bytes=host_free, fits=fits, devices=devices,
    )
