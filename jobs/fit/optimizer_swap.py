"""``offload.host_memory_limit`` for a full fine-tune: when the CPU optimizer's state does not fit beside the
engine's pinned memory, it lives in swap files in the job's output folder (offload/optimizer_swap.py).

A full fine-tune under optimizer offload holds on the host the trainable masters and their gradients (pinned,
the engine's arena) and AdamW's two moments (ordinary memory): twice the masters again. The limit bounds them
together. Where they exceed it, the moments go to disk and host memory holds only the swap ring:
``offload.disk_read_ahead + 1`` slots of the largest weight's state. The estimate and the job decide with the
same function over the same figures, so the fit check's answer is the job's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobs.fit.host_memory import OPTIMIZER_STATES
from jobs.fit.sizes import human_bytes
from jobs.spec.job import JobSpec
from offload import MemoryPlan
from offload.direct_io import align_up

SWAP_FOLDER = "optimizer_swap"  # in the job's output folder


@dataclass(frozen=True)
class SwapDecision:
    """Whether the CPU optimizer's state goes to disk, and the figures that decided it.

    Attributes:
        swap: the state lives in swap files.
        state_bytes: the optimizer's state in memory (without the swap).
        swap_bytes: its swap files (with the swap): each state tensor's bytes padded to O_DIRECT's 4096.
        ring_bytes: the swap ring the state is read into (host memory with the swap).
        message: what the job's log events and the estimate's notes say.
        blocked: the state does not fit but another setting keeps it in memory (the message names it).
    """

    swap: bool
    state_bytes: int
    swap_bytes: int
    ring_bytes: int
    message: str
    blocked: bool = False

    @property
    def host_bytes(self) -> int:
        """What the optimizer's state holds in host memory."""
        return self.ring_bytes if self.swap else self.state_bytes


def swap_applies(spec: JobSpec) -> bool:
    """A full fine-tune whose CPU optimizer runs on the engine's worker (the only place its state is swapped):
    model and optimizer offload, no adapters, a host limit, exact updates without gradient clipping."""
    offload = spec.offload
    return (
        offload.host_memory_limit is not None
        and offload.enable_model_cpu_offload
        and offload.enable_optimizer_cpu_offload
        and spec.lora is None
    )


def decide_optimizer_swap(spec: JobSpec, plan: MemoryPlan, hosted: list[torch.Tensor]) -> SwapDecision | None:
    """Whether ``spec``'s CPU optimizer state over the ``hosted`` trainable weights (those the engine keeps on the
    host, its own parts of them with an optimizer shard) fits beside ``plan``'s pinned memory under the host limit;
    None where the swap does not apply (`swap_applies`)."""
    if not swap_applies(spec):
        return None
    limit = plan.host_memory_limit
    assert limit is not None  # swap_applies: a host limit
    states = OPTIMIZER_STATES[spec.training.optimizer]
    sizes = [t.numel() * _master_element_bytes(t, spec) for t in hosted]
    state = states * sum(sizes)
    files = [states * align_up(size) for size in sizes]  # the swap files' layout (offload/optimizer_swap.py)
    on_disk, ring = sum(files), (spec.offload.disk_read_ahead + 1) * max(files, default=0)
    if plan.host_bytes + state <= limit:
        message = (
            f"offload.host_memory_limit {human_bytes(limit)}: the CPU optimizer's state ({human_bytes(state)}) fits in "
            f"memory beside the engine's pinned {human_bytes(plan.host_bytes)}"
        )
        return SwapDecision(False, state, on_disk, 0, message)
    blocked = _why_not(spec)
    if blocked:
        message = (
            f"offload.host_memory_limit {human_bytes(limit)}: the CPU optimizer's state ({human_bytes(state)}) does "
            f"not fit beside the engine's pinned {human_bytes(plan.host_bytes)}, and stays in memory: {blocked}"
        )
        return SwapDecision(False, state, on_disk, 0, message, blocked=True)
    message = (
        f"offload.host_memory_limit {human_bytes(limit)}: the CPU optimizer's state ({human_bytes(state)}) does not "
        f"fit beside the engine's pinned {human_bytes(plan.host_bytes)}, so it lives in swap files in the job's "
        f"{SWAP_FOLDER}/ folder, read before each weight's update through a {human_bytes(ring)} ring "
        f"({spec.offload.disk_read_ahead + 1} slots of the largest weight's state) and written back after it: "
        f"{human_bytes(2 * on_disk)} of disk reads and writes a step"
    )
    return SwapDecision(True, state, on_disk, ring, message)


def _why_not(spec: JobSpec) -> str:
    """Why the state cannot be swapped ("" where it can)."""
    if spec.training.max_grad_norm is not None:
        return (
            "training.max_grad_norm steps the optimizer in one call over every weight, so its state must be in "
            "memory at once; unset it to swap the state to disk"
        )
    if spec.offload.delayed_update:
        return "offload.delayed_update runs the updates during the next step; set it false to swap the state to disk"
    return ""


def _master_element_bytes(tensor: torch.Tensor, spec: JobSpec) -> int:
    """A master's element size: float32 under mixed precision (keep_trainable_in_float32), else its own."""
    if spec.training.mixed_precision != "no" and tensor.is_floating_point():
        return 4
    return tensor.element_size()
