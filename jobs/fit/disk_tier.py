"""``offload.host_memory_limit`` in the estimate: where the engine finds frozen weights on disk, and what the
disk tier (offload/disk.py) then reads each step.

The estimate plans the engine's memory with the same locator the job gives the engine: the model family's
weight source, made from the checkpoint's headers (no tensor is read), asked by tensor name. So the units the
estimate puts on disk are the ones the job will, and a weight that the job transforms on load (quantized,
converted from fused or differently typed tensors) has no range there and stays in RAM in both.
"""

from __future__ import annotations

from typing import Any

import torch

from jobs.fit.sizes import human_bytes
from jobs.models.family import ModelFamily
from jobs.models.registry import family_of
from jobs.spec.job import JobSpec
from offload import MemoryPlan
from offload.disk import DiskLocator

# What a Gen5 NVMe drive reads at, sequentially (the figure docs/offload.md works the 70B case with).
NVME_GEN5_BYTES_PER_S = 14e9


def loads_into_pinned_memory(spec: JobSpec, family: ModelFamily[Any]) -> bool:
    """Whether the job builds its model on the meta device and fills the engine's pinned arena straight from
    its weight source: model offload with a family that can, and the trainable weights either adapters
    (materialized apart) or hosted by optimizer offload (full fine-tuning without it keeps every weight on
    the device). Only such a job can leave frozen weights in their files. Not with ``lora.modules_to_save``: peft
    copies those modules' values when it wraps them, and a meta module has none (the copy would train from the
    zeros standing in for it, jobs/models/lora.py ``adapters_stay_on_the_cpu``)."""
    offload = spec.offload
    return (
        offload.enable_model_cpu_offload
        and family.build_on_meta is not None
        and (spec.lora is not None or offload.enable_optimizer_cpu_offload)
        and (spec.lora is None or (not spec.lora.modules_to_save and _adapts_on_meta(spec, family)))
    )


def _adapts_on_meta(spec: JobSpec, family: ModelFamily[Any]) -> bool:
    """peft's adapters need no base weight's values; a family's own ``apply_lora`` may, unless it says not."""
    if family.apply_lora is None:
        return True
    return family.adapts_on_meta is not None and family.adapts_on_meta(spec)


def with_host_memory_limit(spec: JobSpec, limit: int | None) -> JobSpec:
    """``spec`` with ``offload.host_memory_limit`` set to ``limit`` (a server's share of its host memory budget)
    where it sets none and offloads its model; unchanged otherwise."""
    offload = spec.offload
    if limit is None or offload.host_memory_limit is not None or not offload.enable_model_cpu_offload:
        return spec
    return spec.model_copy(update={"offload": offload.model_copy(update={"host_memory_limit": limit})})


def disk_locator(spec: JobSpec) -> DiskLocator | None:
    """Where the job's frozen weights lie in its checkpoint files, by name; None without a host limit or
    where the job cannot stream from its files."""
    if spec.offload.host_memory_limit is None:
        return None
    family = family_of(spec.model)
    if not loads_into_pinned_memory(spec, family):
        return None
    assert family.build_on_meta is not None  # loads_into_pinned_memory says so
    _, source = family.build_on_meta(spec.model, spec.training.seed, torch.device("cpu"))
    return source.file_range


def disk_read_bytes_per_step(plan: MemoryPlan) -> int:
    """What the disk tier reads in a step: each disk unit once for the forward and once for the backward (the
    recompute's copy serves the backward too). The units still in their device slots at the step's two
    turnarounds read nothing, so this is an upper bound by a few units."""
    return 2 * plan.disk_bytes


def disk_notes(plan: MemoryPlan, limit: int) -> list[str]:
    """The estimate's notes on the disk tier."""
    gib = 2**30
    if not plan.disk_bytes and not plan.host_fits:  # the pinned rest (a full fine-tune's masters) is beyond it
        return [
            f"offload.host_memory_limit {human_bytes(limit)}: no frozen weight goes to disk, and the engine's pinned "
            f"host memory ({human_bytes(plan.host_bytes)}) exceeds it"
        ]
    if not plan.disk_bytes:
        return [f"offload.host_memory_limit {limit / gib:.2f} GiB: every frozen weight fits in RAM"]
    per_step = disk_read_bytes_per_step(plan)
    return [
        f"offload.host_memory_limit {limit / gib:.2f} GiB: {plan.disk_bytes / gib:.2f} GiB of frozen weights read "
        f"from the checkpoint's files on each use through a {plan.staging_bytes / gib:.2f} GiB pinned staging ring "
        f"(pinned host memory {plan.host_bytes / gib:.2f} GiB in all)",
        f"the disk tier reads up to {per_step / gib:.2f} GiB a step: a step takes at least "
        f"{per_step / NVME_GEN5_BYTES_PER_S:.2f} s at {NVME_GEN5_BYTES_PER_S / 1e9:.0f} GB/s (Gen5 NVMe), so the disk "
        f"must read {per_step / 1e9:.1f} GB per second of compute for it to cost nothing",
    ]
