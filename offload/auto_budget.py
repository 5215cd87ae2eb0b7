"""``gpu_memory_budget="auto"``: the budget measured from the steps that streamed every unit.

A hand-set budget is a guess at what the job's other memory peaks at (activations, gradients, optimizer
state, the ring). Guess high and the job runs out of memory; guess low and weights that would fit are
copied every step. The engine can measure it instead: the first steps stream every unit, and the peak the
caching allocator reserved in them is what the job needs besides the weights it could keep. Everything the
process may still reserve above that peak, less a margin, becomes the budget.

Measured after the second step, not the first: an optimizer creates its state on its first ``step()``,
which comes after the first backward, so the first step's peak lacks it.
"""

from __future__ import annotations

import torch

from offload.options import AUTO_BUDGET

__all__ = [
    "AUTO_BUDGET",
    "MEASURED_AFTER_STEPS",
    "margin_bytes",
    "measured_budget",
    "room_for_weights",
    "start_measuring",
]
MEASURED_AFTER_STEPS = 2
# Kept free under the ceiling: allocator fragmentation (the caching allocator reserves more than is allocated,
# and the gap grows with the job) and what later steps allocate that the measured ones did not.
MARGIN_FRACTION = 1 / 16
MIN_MARGIN_BYTES = 512 << 20


def margin_bytes(ceiling: int) -> int:
    """What the budget leaves free under ``ceiling``: 1/16 of it, at least 512 MiB."""
    return max(MIN_MARGIN_BYTES, int(ceiling * MARGIN_FRACTION))


def room_for_weights(ceiling: int, peak: int) -> int:
    """Bytes of weights that may stay resident when the job's other memory peaks at ``peak`` (estimated
    or measured) under ``ceiling``: the ceiling less the peak and the margin, never below 0."""
    return max(0, ceiling - peak - margin_bytes(ceiling))


def start_measuring(device: torch.device) -> None:
    """Measure this manager's steps from here: the CUDA peak statistics are process-wide since their last
    reset, so a process that ran something larger before (an earlier job in a notebook, a test) would
    otherwise measure that and get no budget at all."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measured_budget(device: torch.device, gpu_memory_limit: int | None) -> int | None:
    """Bytes of weights that may stay resident on ``device`` from now on; ``None`` where the device keeps
    no memory statistics (the CPU: nothing to measure, every unit keeps streaming).

    The ceiling is ``gpu_memory_limit`` or, without one, what this process reserves plus what the device
    has free (other processes' memory excluded). The budget is the ceiling less the peak reserved so far
    and less the margin (1/16 of the ceiling, at least 512 MiB); never below 0.
    """
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    reachable = torch.cuda.memory_reserved(device) + free
    ceiling = min(gpu_memory_limit, reachable) if gpu_memory_limit else reachable
    return room_for_weights(ceiling, torch.cuda.max_memory_reserved(device))
