"""``offload.gpu_memory_budget: auto`` decided from the fit check's estimate: keep resident what fits.

The ceiling is ``offload.gpu_memory_limit`` or, without one, the GPU's memory. The job's other memory
(activations, gradients, optimizer state, the ring of streamed units) is the estimate's peak with every unit
streamed; what the ceiling leaves above it, less a margin (offload/auto_budget.py), holds weights for good.
A model that fits then runs at resident speed with no setting.

On a GPU the engine refines the figure from the peak it measures in the first two steps (which stream every
unit) and keeps what that leaves; the estimate is what the job reports at its start. Elsewhere there is
nothing to measure, so the estimate decides, and the same spec always gets the same budget: a CPU job with a
``gpu_memory_limit`` keeps exactly what an explicit budget of the reported size would.

Example:
    >>> decision = decide_budget(load_job_spec(Path("configs/cpu_smoke.yaml").read_text()))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobs.fit.sizes import human_bytes
from jobs.spec.job import JobSpec
from offload import parse_bytes
from offload.auto_budget import margin_bytes, room_for_weights
from offload.options import AUTO_BUDGET


@dataclass(frozen=True)
class BudgetDecision:
    """What ``auto`` became for one job.

    Attributes:
        engine_budget: the engine's ``gpu_memory_budget``: bytes, ``None`` (stream every unit) or ``"auto"``
            (on a GPU: measured after the second step, the estimate only reported).
        resident_bytes: the estimated bytes of weights kept resident (0: every unit streams).
        weight_bytes: the model's weights and buffers.
        message: the decision and its numbers, for the job's events.
    """

    engine_budget: int | str | None
    resident_bytes: int
    weight_bytes: int
    message: str


def with_budget(spec: JobSpec, budget: int | str | None) -> JobSpec:
    """``spec`` with ``offload.gpu_memory_budget`` replaced (validation skipped: ``budget`` is below the limit)."""
    return spec.model_copy(update={"offload": spec.offload.model_copy(update={"gpu_memory_budget": budget})})


def runs_on_gpu(spec: JobSpec) -> bool:
    """Whether the job's device is a CUDA GPU here (``device: auto`` picks one when present)."""
    return spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())


def device_ceiling(spec: JobSpec) -> tuple[int | None, str]:
    """The device bytes the job may use and where the figure comes from; ``None`` without a
    ``gpu_memory_limit`` where no GPU is here (the CPU, or the fit check of a GPU job on a machine without one)."""
    limit = parse_bytes(spec.offload.gpu_memory_limit, name="offload.gpu_memory_limit")
    if limit is not None:
        return limit, "offload.gpu_memory_limit"
    if runs_on_gpu(spec) and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "the GPU's memory"
    return None, ""


def decide_budget(spec: JobSpec) -> BudgetDecision | None:
    """``auto`` decided for ``spec``; ``None`` where the spec sets a budget or does not offload the model."""
    if spec.offload.gpu_memory_budget != AUTO_BUDGET or not spec.offload.enable_model_cpu_offload:
        return None
    from jobs.fit.estimate import estimate_memory  # the estimate asks this module in turn

    streamed = estimate_memory(with_budget(spec, None))
    weights = streamed.weight_bytes
    ceiling, source = device_ceiling(spec)
    if ceiling is None and runs_on_gpu(spec):
        message = (
            f"offload.gpu_memory_budget auto: of {human_bytes(weights)} weights, the engine keeps what the GPU "
            "leaves above the peak measured in the first two steps (no GPU here to estimate it against)"
        )
        return BudgetDecision(AUTO_BUDGET, 0, weights, message)
    if ceiling is None:
        message = (
            f"offload.gpu_memory_budget auto -> {human_bytes(0)} resident of {human_bytes(weights)} weights because the job "
            "runs on the CPU with no offload.gpu_memory_limit to size it against: every unit streams "
            "(set offload.gpu_memory_limit, or a gpu_memory_budget)"
        )
        return BudgetDecision(None, 0, weights, message)
    room = room_for_weights(ceiling, streamed.peak_device_bytes)
    resident = min(room, weights)
    message = (
        f"offload.gpu_memory_budget auto -> {human_bytes(resident)} resident of {human_bytes(weights)} weights "
        f"because {source} {human_bytes(ceiling)} less the estimated streamed peak "
        f"{human_bytes(streamed.peak_device_bytes)} (activations, gradients, optimizer state, ring) less a "
        f"margin of {human_bytes(margin_bytes(ceiling))} leaves {human_bytes(room)}"
    )
    if runs_on_gpu(spec):
        message += "; the engine refines it from the peak measured in the first two steps"
        return BudgetDecision(AUTO_BUDGET, resident, weights, message)
    return BudgetDecision(room or None, resident, weights, message)
