"""Can this machine run the job? The device and host-memory checks that the service runs at submit and
``python -m jobs validate`` / ``run`` run before any work, with the same messages.

Each check returns a problem (the spec path it concerns and what is wrong, with the fix) or None; the
caller decides how to refuse: the service with a 422, the command line with exit code 2.

Example:
    >>> device_problem(spec, has_gpu=False)
    ('device', 'device: cuda, but no CUDA device is available here; set device: cpu or auto, or run it on a machine with a GPU')
"""

from __future__ import annotations

import os

from jobs.errors import Problem
from jobs.fit.estimate import human_bytes
from jobs.fit.host_memory import rank_processes_host_bytes
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


# training.compile over the offload engine on CUDA, measured on an H100 (torch 2.11, commit f02ebe7): inductor's
# compiled blocks under the engine gave NaN losses from the second step (tests/jobs/models/test_compiled_blocks.py's
# gpu test), an illegal memory access with every unit kept (bench/speed_bench.py's ferry+liger+compile cell), and
# int8/NF4 bases failed to swap their payloads back (inductor keeps weak references to the weights). On the CPU
# (aot_eager) the same paths train bit for bit like eager. Until the GPU path is mended a job asking for it is
# refused rather than run to a NaN or a crash.
COMPILE_OVER_OFFLOAD_ON_CUDA = (
    "training.compile with offload.enable_model_cpu_offload is not supported on a CUDA device in this version: the "
    "compiled blocks gave NaN losses or an illegal memory access under the offload engine on an H100 "
    "(issue 53); set training.compile: false (training.kernels: liger keeps the fused kernels), or turn model "
    "offload off where the model fits"
)


UNSAFE_COMPILE_SWITCH = "FERRY_UNSAFE_COMPILE_OVER_OFFLOAD"  # "1": run it anyway (to measure or mend the path)


def compile_over_offload_allowed() -> bool:
    """Whether the developer's switch lets ``training.compile`` run over the offload engine on CUDA."""
    return os.environ.get(UNSAFE_COMPILE_SWITCH) == "1"


def compile_problem(spec: JobSpec, *, has_gpu: bool) -> Problem | None:
    """``training.compile`` over the offload engine on a job that will run on CUDA (see above)."""
    if compile_over_offload_allowed():
        return None
    on_cuda = spec.device == "cuda" or (spec.device == "auto" and has_gpu)
    if not (spec.training.compile and spec.offload.enable_model_cpu_offload and on_cuda):
        return None
    return "training.compile", COMPILE_OVER_OFFLOAD_ON_CUDA


def host_memory_problem(
    *,
    peak_device_bytes: int,
    pinned_host_bytes: int,
    host_total_bytes: int,
    on_host: bool,
    optimizer_host_bytes: int = 0,
    ranks: int = 1,
) -> Problem | None:
    """More host memory than the machine has: the whole peak of each rank of a job on the CPU (``on_host``),
    the pinned copies (page-locked memory cannot be swapped out), every rank's CPU optimizer state (held for
    the whole run) and, with several ranks, each rank process's own memory always. The figures come from
    `estimate_memory` (``optimizer_host_bytes`` is per rank)."""
    optimizer = ranks * optimizer_host_bytes
    peak = ranks * peak_device_bytes if on_host else 0
    processes = rank_processes_host_bytes(ranks)
    needed = pinned_host_bytes + optimizer + peak + processes
    if needed <= host_total_bytes:
        return None
    state = f" + CPU optimizer state {human_bytes(optimizer)}" if optimizer else ""
    if processes:
        state += f" + {ranks} rank processes {human_bytes(processes)}"
    if on_host:
        each = f" x {ranks} ranks" if ranks > 1 else ""
        message = (
            f"the job needs an estimated {human_bytes(needed)} of host memory (peak {human_bytes(peak_device_bytes)}"
            f"{each} + pinned copies {human_bytes(pinned_host_bytes)}{state}) but this machine has "
            f"{human_bytes(host_total_bytes)}"
        )
    elif optimizer or processes:
        message = (
            f"the job needs an estimated {human_bytes(needed)} of host memory (pinned copies "
            f"{human_bytes(pinned_host_bytes)}{state}) but this machine has {human_bytes(host_total_bytes)}"
        )
    else:
        message = (
            f"the offload engine's pinned host copies need {pinned_host_bytes / GIB:.1f} GiB but this machine "
            f"has {host_total_bytes / GIB:.1f} GiB of memory"
        )
    return "model", message


def host_limit_problem(
    *,
    host_memory_limit: int | None,
    engine_host_bytes: int,
    disk_bytes: int,
    fits: bool,
    trainable_host_bytes: int = 0,
    optimizer_host_bytes: int = 0,
    optimizer_swap_bytes: int = 0,
) -> Problem | None:
    """``offload.host_memory_limit`` that neither RAM nor the disk tier can keep: the engine's pinned host memory
    (``engine_host_bytes``) exceeds it even with every frozen weight it can read from the checkpoint's files left
    there (``disk_bytes``). A full fine-tune (``trainable_host_bytes``: its pinned masters and gradients) is told
    so with its own figures (`full_fine_tune_beyond_limit`). The figures come from `estimate_memory`
    (``host_limit_fits`` is ``fits``)."""
    if fits or host_memory_limit is None:
        return None
    limit, needed = host_memory_limit, engine_host_bytes
    if trainable_host_bytes:
        message = full_fine_tune_beyond_limit(
            limit, needed, trainable_host_bytes, optimizer_host_bytes, optimizer_swap_bytes, disk_bytes
        )
        return "offload.host_memory_limit", message
    if disk_bytes:
        why = (
            f"even with {human_bytes(disk_bytes)} of frozen weights read from the checkpoint's files (the "
            "rest are buffers, trainable weights, the staging ring and weights the job transforms on load: "
            "quantized, converted or stored in another dtype)"
        )
        fix = f"raise it to at least {human_bytes(needed)}, or lower offload.disk_read_ahead"
    else:
        why = (
            "and none of its frozen weights can be read from a checkpoint file (the model is drawn at random or "
            "seeded, built in memory, or transforms every weight on load)"
        )
        fix = (
            f"raise it to at least {human_bytes(needed)}, or load the model from safetensors (model.weights or "
            "model.path) with offload.enable_model_cpu_offload and lora or optimizer offload"
        )
    return (
        "offload.host_memory_limit",
        f"offload.host_memory_limit is {human_bytes(limit)} but the offload engine's pinned host memory needs an "
        f"estimated {human_bytes(needed)} {why}; {fix}",
    )


def full_fine_tune_beyond_limit(
    limit: int, needed: int, trainable: int, optimizer_host: int, swapped: int, disk_bytes: int
) -> str:
    """A full fine-tune the limit cannot hold even with its optimizer state in swap files: the masters and their
    gradients stay pinned (the engine streams them to the device each step and the CPU optimizer updates them in
    place), so the limit must hold them; the fixes in the order they keep the job as it was."""
    if swapped:
        state = (
            f"the optimizer state's swap ring {human_bytes(optimizer_host)} (the state itself, "
            f"{human_bytes(swapped)}, already in swap files on disk)"
        )
    else:
        state = (
            f"the CPU optimizer state {human_bytes(optimizer_host)}, which stays in memory (training.max_grad_norm or "
            "offload.delayed_update keeps it there: unset them to swap it to disk)"
        )
    rest = needed - trainable - optimizer_host
    frozen = f", {human_bytes(disk_bytes)} of frozen weights already read from disk" if disk_bytes else ""
    return (
        f"offload.host_memory_limit is {human_bytes(limit)} but this full fine-tune needs an estimated "
        f"{human_bytes(needed)} of host memory{' even with its optimizer state swapped to disk' if swapped else ''}: "
        "the trainable weights' "
        f"pinned host masters and their gradients {human_bytes(trainable)} + {state} + buffers, frozen weights and "
        f"the staging ring {human_bytes(max(0, rest))}{frozen}; the masters and gradients cannot go to disk. Fixes, "
        f"in order: raise offload.host_memory_limit to at least {human_bytes(needed)}; or train LoRA adapters (a "
        "lora: section), whose frozen base the disk tier reads from the checkpoint's files; or, with LoRA, quantize "
        "the frozen weights (model.quantize: nf4) to hold a quarter of their bytes; or train a smaller model"
    )
