"""The dry-run fit check: the spec's memory estimate against this service's GPUs and host memory."""

from __future__ import annotations

import psutil

from jobs import JobSpec, estimate_memory, line_of, parse_bytes
from jobs.fit.checks import compile_problem, device_problem, host_limit_problem, host_memory_problem
from jobs.spec.text import ParsedSpec
from service.checking.fit_shapes import DeviceFit, FitEstimate
from service.errors import ApiError
from service.workers.devices import GpuInfo, Slot

GIB = 2**30


def estimate_fit(spec: JobSpec, slots: list[Slot], gpus: list[GpuInfo]) -> FitEstimate:
    """Does the job fit every worker it could be given? On CPU workers device and pinned memory are host RAM.

    A GPU's usable memory is the smaller of its size and ``offload.gpu_memory_limit`` (the job's process is
    held to the limit however large the card is).
    """
    estimate = estimate_memory(spec)
    host_free = psutil.virtual_memory().available
    limit = parse_bytes(spec.offload.gpu_memory_limit)
    by_index = {gpu.index: gpu for gpu in gpus}
    devices = []
    for slot in slots:
        if slot.device is None:
            total, fits = None, estimate.ranks * estimate.peak_device_bytes + estimate.host_bytes <= host_free
        else:
            gpu = by_index.get(slot.device)
            total = gpu.memory_total_bytes if gpu else None
            usable = limit if total is None else min(total, limit or total)
            fits = None if total is None else estimate.peak_device_bytes <= usable
        devices.append(
            DeviceFit(worker=slot.id, device=slot.device, memory_total_bytes=total, memory_limit_bytes=limit, fits=fits)
        )
    host_fits = estimate.host_bytes <= host_free
    verdicts = [d.fits for d in devices]
    fits = None if None in verdicts else (all(verdicts) and host_fits and estimate.host_limit_fits)
    return FitEstimate(
        peak_device_bytes=estimate.peak_device_bytes,
        pinned_host_bytes=estimate.pinned_host_bytes,
        optimizer_host_bytes=estimate.optimizer_host_bytes,
        ranks=estimate.ranks,
        notes=list(estimate.notes),
        host_available_bytes=host_free,
        host_total_bytes=psutil.virtual_memory().total,
        fits=fits,
        devices=devices,
        host_memory_limit_bytes=estimate.host_memory_limit,
        engine_host_bytes=estimate.engine_host_bytes,
        disk_bytes=estimate.disk_bytes,
        disk_read_bytes_per_step=estimate.disk_read_bytes_per_step,
        host_limit_fits=estimate.host_limit_fits,
        trainable_host_bytes=estimate.trainable_host_bytes,
        optimizer_swap_bytes=estimate.optimizer_swap_bytes,
    )


def refuse_if_it_cannot_fit(spec: JobSpec, fit: FitEstimate, text: str | ParsedSpec = "") -> None:
    """Raise 422 ``does_not_fit`` when a GPU job's estimated peak exceeds the memory of every GPU worker.

    Such a job would wait its turn, spend minutes building the model, then die of out-of-memory; refusing
    it at submit says so at once. Only a definite "no" on every GPU refuses: unknown GPU sizes or a job
    for the CPU never do, and ``?fit_check=false`` queues it anyway (the estimate can be wrong). Each
    problem carries the line of its setting in ``text`` (the spec as submitted), or of its section.
    """
    refuse_if_beyond_the_host(spec, fit, text)
    gpu_verdicts = [d.fits for d in fit.devices if d.device is not None]
    if spec.device == "cpu" or not gpu_verdicts or any(v is not False for v in gpu_verdicts):
        return
    largest = max(d.memory_total_bytes or 0 for d in fit.devices if d.device is not None)
    limit = parse_bytes(spec.offload.gpu_memory_limit)
    if limit is not None and limit < largest:
        message = (
            f"the estimated peak of {fit.peak_device_bytes / GIB:.1f} GiB exceeds offload.gpu_memory_limit "
            f"({spec.offload.gpu_memory_limit} = {limit / GIB:.1f} GiB; the largest GPU here has {largest / GIB:.1f} GiB)"
        )
    else:
        message = (
            f"the estimated peak of {fit.peak_device_bytes / GIB:.1f} GiB exceeds the largest GPU here "
            f"({largest / GIB:.1f} GiB)"
        )
    fixes = _fixes(spec)
    if limit is not None and limit < largest:
        fixes.append(("offload.gpu_memory_limit", f"at least {fit.peak_device_bytes / GIB:.1f}GiB", "or unset it"))
    problems = [
        {
            "path": path,
            "message": f"{message}; set it to {value} ({why})",
            "line": _line_of(text, path),
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


def refuse_if_beyond_the_host(spec: JobSpec, fit: FitEstimate, text: str | ParsedSpec = "") -> None:
    """Raise 422 ``does_not_fit`` when the job needs more host memory than this machine has.

    A job on a CPU worker holds its whole peak in host memory; pinned (page-locked) copies cannot be
    swapped out either. Such a job would die building its model or arena (or take the host down with it).
    """
    limited = host_limit_problem(
        host_memory_limit=fit.host_memory_limit_bytes,
        engine_host_bytes=fit.engine_host_bytes,
        disk_bytes=fit.disk_bytes,
        fits=fit.host_limit_fits,
        trainable_host_bytes=fit.trainable_host_bytes,
        optimizer_host_bytes=fit.optimizer_host_bytes,
        optimizer_swap_bytes=fit.optimizer_swap_bytes,
    )
    if limited is not None:
        path, message = limited
        raise ApiError(
            422,
            "does_not_fit",
            f"The job cannot keep to its host memory limit: {message}. Submit with ?fit_check=false to queue it "
            "anyway.",
            problems=[{"path": path, "message": message, "line": _line_of(text, path), "suggestion": None}],
        )
    on_host = spec.device == "cpu" or all(d.device is None for d in fit.devices)
    problem = host_memory_problem(
        peak_device_bytes=fit.peak_device_bytes,
        pinned_host_bytes=fit.pinned_host_bytes,
        host_total_bytes=fit.host_total_bytes,
        on_host=on_host,
        optimizer_host_bytes=fit.optimizer_host_bytes,
        ranks=fit.ranks,
    )
    if problem is None:
        return
    path, message = problem
    raise ApiError(
        422,
        "does_not_fit",
        f"The job cannot fit in this host's memory: {message}. Use a smaller model or a host with more "
        "memory. Submit with ?fit_check=false to queue it anyway.",
        problems=[
            {
                "path": path,
                "message": f"{message}; use a smaller model or a host with more memory",
                "line": _line_of(text, path),
                "suggestion": None,
            }
        ],
    )


def refuse_if_no_worker_has_the_device(spec: JobSpec, slots: list[Slot], text: str | ParsedSpec = "") -> None:
    """Raise 422 ``device_unavailable`` for a ``device: cuda`` job on a service without a GPU worker.

    It would wait in the queue for ever (or run on no GPU); ``?queue_anyway=true`` queues it still, for a
    server about to gain a GPU worker.
    """
    problem = device_problem(
        spec,
        has_gpu=any(slot.device is not None for slot in slots),
        where=f"this service has no GPU worker (its workers: {', '.join(s.id for s in slots)})",
        elsewhere="run the service on a machine with a GPU",
    )
    if problem is None:
        return
    path, message = problem
    raise ApiError(
        422,
        "device_unavailable",
        f"The job cannot run here: {message}. Submit with ?queue_anyway=true to queue it anyway.",
        problems=[
            {
                "path": path,
                "message": message,
                "line": _line_of(text, path),
                "suggestion": None,
            }
        ],
    )


def refuse_compile_over_offload_on_a_gpu(spec: JobSpec, slots: list[Slot], text: str | ParsedSpec = "") -> None:
    """Raise 422 ``unsupported`` for ``training.compile`` over the offload engine where the job would run on a
    GPU worker (jobs/fit/checks.py says what the H100 run showed); nothing is stored."""
    problem = compile_problem(spec, has_gpu=any(slot.device is not None for slot in slots))
    if problem is None:
        return
    path, message = problem
    raise ApiError(
        422,
        "unsupported",
        f"The job cannot run here: {message}.",
        problems=[{"path": path, "message": message, "line": _line_of(text, path), "suggestion": None}],
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


def _line_of(text: str | ParsedSpec, path: str) -> int | None:
    """The line of ``path`` in the spec as submitted: from its parse when the caller has one."""
    if isinstance(text, ParsedSpec):
        return text.line_of(path)
    return line_of(text, path) if text else None
