"""The host side of the memory estimate under optimizer offload and data parallelism: each rank's CPU optimizer
state (its part when the ranks split the optimizer, ``jobs/distributed/optimizer_shards.py``) and the host copies
each rank holds for itself beside the frozen weights' copy the machine's ranks share."""

from __future__ import annotations

import torch
from torch import nn

from jobs.distributed.optimizer_shards import splits_optimizer
from jobs.spec.job import JobSpec
from offload import MemoryPlan, OptimizerShard
from offload.arena import aligned

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}  # state tensors per weight: AdamW's two moments, momentum
# Host memory of each rank process beyond its tensors: Python, torch and its libraries, the process group.
# Measured on a gloo CPU rank of a toy job (torch 2.13 CPU, Python 3.11; 2 and 4 ranks): 229-235 MiB unique
# (USS), 238-245 MiB proportional (PSS), 327-333 MiB RSS (the shared libraries counted in every rank). A CUDA
# rank holds more (its CUDA context's host side): this is its floor.
RANK_PROCESS_HOST_BYTES = 240 << 20


def rank_processes_host_bytes(ranks: int) -> int:
    """What the rank processes of a data-parallel job hold besides their tensors (none for one rank: the job's
    own process trains then, as it always runs)."""
    return ranks * RANK_PROCESS_HOST_BYTES if ranks > 1 else 0


def hosted_trainables(model: nn.Module, spec: JobSpec, plan: MemoryPlan) -> list[nn.Parameter]:
    """The trainable weights whose masters and optimizer live on the host (optimizer offload, full fine-tune)."""
    if not spec.offload.enable_optimizer_cpu_offload:
        return []
    unique = {id(p): p for p in model.parameters() if p.requires_grad}
    return [p for key, p in unique.items() if key not in plan.device_trainables]


def rank_shard(spec: JobSpec) -> OptimizerShard | None:
    """Rank 0's share when the ranks split the CPU optimizer: the largest part of every weight."""
    return OptimizerShard(0, spec.distributed.world_size) if splits_optimizer(spec) else None


def host_optimizer_bytes(model: nn.Module, spec: JobSpec, plan: MemoryPlan, lora: int) -> int:
    """One rank's CPU optimizer state: the optimizer's states per element of the weights it steps there."""
    states, shard = OPTIMIZER_STATES[spec.training.optimizer], rank_shard(spec)
    if spec.lora is not None:  # the adapters, which peft adds to the model after the base
        return states * (-(-lora // shard.world_size) if shard else lora)
    return states * sum(
        (shard.part(p.numel()).numel if shard else p.numel()) * p.element_size()
        for p in hosted_trainables(model, spec, plan)
    )


def hosted_state_tensors(model: nn.Module, spec: JobSpec, plan: MemoryPlan) -> list[torch.Tensor]:
    """Shape-only stand-ins of what one rank's CPU optimizer steps: each hosted trainable weight, or its part."""
    shard = rank_shard(spec)
    return [
        torch.empty(shard.part(p.numel()).numel if shard else p.numel(), dtype=p.dtype, device="meta")
        for p in hosted_trainables(model, spec, plan)
    ]


def trainable_host_bytes(model: nn.Module, spec: JobSpec, plan: MemoryPlan) -> int:
    """One rank's pinned host masters of the trainable weights it hosts with their gradient buffers (a part of
    each when the ranks split the optimizer): what a full fine-tune under optimizer offload cannot put on disk."""
    shard = rank_shard(spec)
    own = 0
    for param in hosted_trainables(model, spec, plan):
        part = shard.part(param.numel()).numel if shard else param.numel()
        own += aligned(param.numel() * param.element_size()) + aligned(max(1, part) * param.element_size())
    return own


def own_host_bytes(model: nn.Module, spec: JobSpec, plan: MemoryPlan, lora: int) -> int:
    """The host copies a rank holds for itself: trainable masters with their gradient buffers (a part of each
    when the ranks split the optimizer) and buffers. The frozen weights' copy is the machine's, shared."""
    own = sum(aligned(b.numel() * b.element_size()) for b in model.buffers())
    own += trainable_host_bytes(model, spec, plan)
    if spec.lora is not None and spec.offload.enable_optimizer_cpu_offload:
        own += 2 * lora  # the adapters and their gradients
    return own
