"""Resolving the target device and deciding whether host memory can be pinned."""

from __future__ import annotations

import gc

import torch


def resolve_target_device(target_device: str | torch.device | int) -> torch.device:
    """Turn the user's ``target_device`` into a concrete ``torch.device`` (with an index for accelerators).

    Raises:
        ValueError: naming ``target_device`` and the fix when the device is unknown or absent.
    """
    try:
        device = torch.device(target_device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"target_device={target_device!r} is not a torch device; use 'cuda', 'cuda:0' or 'cpu'"
        ) from error
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"target_device={target_device!r} but CUDA is not available here; use target_device='cpu' "
                "or run on a machine with a GPU"
            )
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"target_device={target_device!r} but only {torch.cuda.device_count()} CUDA device(s) exist; "
                f"use an index below {torch.cuda.device_count()}"
            )
        return torch.device("cuda", index)
    module = getattr(torch, device.type, None)
    if module is None or not getattr(module, "is_available", lambda: False)():
        raise ValueError(f"target_device={target_device!r}: no {device.type} device is available here")
    return device


def can_pin_memory() -> bool:
    """Page-locked host memory needs an accelerator runtime; without one we use ordinary memory."""
    return torch.cuda.is_available()


def return_cached_host_memory() -> None:
    """Give the page-locked memory that torch's host allocator keeps cached back to the system.

    Pinned tensors (the engine's arena chunks) go back to that allocator's cache when freed, not to the
    system: a process that runs another job after one with a 50 GB arena would otherwise hold those 50 GB
    while the next job allocates its own. Call it once the tensors are gone (a collection first, for the
    ones only a reference cycle still holds). A no-op without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    gc.collect()
    torch._C._host_emptyCache()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU-GPU sync point). A no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        getattr(torch, device.type).synchronize()


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes; ``None`` for the CPU (no separate device memory)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def set_gpu_memory_limit(
    device: torch.device, limit_bytes: int | None, *, name: str = "gpu_memory_limit"
) -> int | None:
    """Hold this process to ``limit_bytes`` of ``device`` memory, as if the card were that small.

    Enforced by the CUDA caching allocator (``torch.cuda.set_per_process_memory_fraction``): an allocation
    that would take the process's reserved memory past the limit fails with an out-of-memory error, even
    when the card has room. The CUDA context itself is outside the allocator and not counted.
    ``None`` lifts the limit. Returns the limit in force (``None`` on the CPU, where it means nothing).

    Raises:
        ValueError: when ``limit_bytes`` exceeds the device's memory (naming both and the fix).
    """
    total = device_memory_bytes(device)
    if total is None:
        return None
    # torch.cuda.set_per_process_memory_fraction refuses a device without an index ("cuda", as
    # resolve_device and accelerate name it): name the one that "cuda" means.
    index = device.index if device.index is not None else torch.cuda.current_device()
    if limit_bytes is None:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        return None
    if limit_bytes > total:
        raise ValueError(
            f"{name} ({limit_bytes / 2**30:.2f} GiB) exceeds {device}'s memory "
            f"({total / 2**30:.2f} GiB); lower it or leave it unset to use the whole device"
        )
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total, index)
    return limit_bytes
