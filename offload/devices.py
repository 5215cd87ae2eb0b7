"""Resolving the target device and deciding whether host memory can be pinned."""

from __future__ import annotations

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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU-GPU sync point). A no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        getattr(torch, device.type).synchronize()
