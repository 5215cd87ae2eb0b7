"""The dry-run fit check: the spec's memory estimate against this service's GPUs and host memory."""

from __future__ import annotations

import psutil

from jobs import JobSpec, estimate_memory, line_of

from .devices import GpuInfo, Slot
from .errors import ApiError
from .schemas import DeviceFit, FitEstimate

GIB = 2**30


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
        peak_device_bytes=estimate.peak_device_bytes,
        pinned_host_bytes=estimate.pinned_host_bytes,
        notes=list(estimate.notes),
        host_available_bytes=host_free,
        fits=fits,
        devices=devices,
    )


def refuse_if_it_cannot_fit(spec: JobSpec, fit: FitEstimate, text: str = "") -> None:
    """Raise 422 ``does_not_fit`` when a GPU job's estimated peak exceeds the memory of every GPU worker.

    Such a job would wait its turn, spend minutes building the model, then die of out-of-memory; refusing
    it at submit says so at once. Only a definite "no" on every GPU refuses: unknown GPU sizes or a job
    for the CPU never do, and ``?fit_check=false`` queues it anyway (the estimate can be wrong). Each
    problem carries the line of its setting in ``text`` (the spec as submitted), or of its section.
    """
    gpu_verdicts = [d.fits for d in fit.devices if d.device is not None]
    if spec.device == "cpu" or not gpu_verdicts or any(v is not False for v in gpu_verdicts):
        return
    largest = max(d.memory_total_bytes or 0 for d in fit.devices if d.device is not None)
    message = (
        f"the estimated peak of {fit.peak_device_bytes / GIB:.1f} GiB exceeds the largest GPU here "
        f"({largest / GIB:.1f} GiB)"
    )
    fixes = _fixes(spec)
    problems = [
        {
            "path": path,
            "message": f"{message}; set it to {value} ({why})",
            "line": line_of(text, path) if text else None,
            "suggestion": None,
        }
        for path, value, why in fixes
    ]
    raise ApiError(
        422,
        "does_not_fit",
        f"The job cannot fit on any GPU of this service: {message}. "
        + " ".join(f"Set {path}: {value} ({why})." for path, value, why in fixes)
        + " Submit with ?fit_check=false to queue it anyway.",
        problems=problems,
    )


def _fixes(spec: JobSpec) -> list[tuple[str, str, str]]:
    """(setting, value, why) for each setting that lowers the peak, the most effective first."""
    fixes = []
    if not spec.offload.enable_model_cpu_offload:
        fixes.append(("offload.enable_model_cpu_offload", "true", "streams the weights from CPU memory"))
    elif not spec.offload.enable_optimizer_cpu_offload and spec.lora is None:
        fixes.append(("offload.enable_optimizer_cpu_offload", "true", "keeps gradients and optimizer state on the CPU"))
    if not spec.training.gradient_checkpointing:
        fixes.append(
            ("training.gradient_checkpointing", "true", "keeps each block's input instead of all its activations")
        )
    if spec.training.batch_size > 1:
        fixes.append(
            (
                "training.batch_size",
                f"less than {spec.training.batch_size}",
                "raise gradient_accumulation_steps to keep the effective batch",
            )
        )
    return fixes or [("model", "a smaller model", "no memory setting is left to turn on")]
