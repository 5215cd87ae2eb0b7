"""A fit check before queueing: peak device memory and pinned host memory, without loading any weight.

The model is built on the meta device (shapes only) and the offload engine's own unit discovery cuts it
into units, so the streaming window is the engine's, not a guess. Activations follow the model family's
own formula (``ModelFamily.activation_bytes``, e.g. per-layer terms for decoder LMs). The device number is what
``torch.cuda.max_memory_allocated`` should report; the CUDA context (~0.5 GiB) and allocator slack come on
top of it in ``nvidia-smi``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from jobs.distributed.optimizer_shards import splits_optimizer
from jobs.fit.budget import decide_budget, with_budget
from jobs.fit.disk_tier import disk_locator, disk_notes, disk_read_bytes_per_step
from jobs.fit.host_memory import (
    OPTIMIZER_STATES,
    RANK_PROCESS_HOST_BYTES,
    host_optimizer_bytes,
    hosted_state_tensors,
    own_host_bytes,
    rank_shard,
    trainable_host_bytes,
)
from jobs.fit.loss_logits import LossLogitsDecision, with_loss_logits_decided
from jobs.fit.optimizer_swap import decide_optimizer_swap
from jobs.fit.sizes import human_bytes
from jobs.models.names import lora_target_matches
from jobs.models.registry import family_of
from jobs.spec.job import JobSpec
from offload import MemoryPlan, parse_bytes, plan_memory
from offload.options import AUTO_BUDGET
from offload.quant.quantized import planned_sizes

_LORA_BYTES = 4  # peft keeps adapters in float32 even on a bf16 base model (autocast_adapter_dtype)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated memory for a job.

    Attributes:
        peak_device_bytes: Peak bytes allocated by PyTorch on the device (on each rank's device).
        pinned_host_bytes: Page-locked host bytes the offload engine reserves (0 without model offload); with
            several ranks, on the machine: the frozen weights' copy that they share once, each rank's own
            host copies (trainable masters, gradient buffers, buffers) once per rank.
        notes: How the numbers were reached, largest contributions first.
        device_ring_bytes: the engine's planned device memory for streamed weights (its ``plan_memory``).
        optimizer_host_bytes: each rank's CPU optimizer state under optimizer offload (ordinary host memory):
            the whole state on one rank, about 1/world_size of it per rank when the ranks split it.
        ranks: the job's data-parallel ranks (``distributed.world_size``), all on one machine.
        weight_bytes: the model's weights and buffers (what ``gpu_memory_budget`` could keep resident).
        host_memory_limit: ``offload.host_memory_limit`` in bytes (None: none).
        disk_bytes: frozen weight bytes the disk tier reads from the checkpoint's files instead of holding them
            (counted in ``pinned_host_bytes`` only as its staging ring); ``disk_read_bytes_per_step``: what it
            reads in a step.
        engine_host_bytes: the offload engine's pinned host memory, the figure ``host_memory_limit`` bounds
            (arena, staging ring, checkpointed inputs; a full fine-tune's CPU optimizer state too);
            ``host_limit_fits``: whether it is within the limit.
        optimizer_swap_bytes: a full fine-tune's CPU optimizer state kept in swap files because the limit has
            no room for it (jobs/fit/optimizer_swap.py); ``optimizer_host_bytes`` is then its swap ring.
        trainable_host_bytes: a full fine-tune's pinned host masters and their gradients (under optimizer
            offload, in ``engine_host_bytes``): the part of it that no disk tier moves.
        whole_logits_peak_bytes: the peak were the loss to make every position's logits at once where it can
            make them chunk by chunk (0: it would make them at once anyway); ``loss_logits``: what the job does,
            decided from it (jobs/fit/loss_logits.py; None: nothing to decide), ``peak_device_bytes`` counting it.
    """

    peak_device_bytes: int
    pinned_host_bytes: int
    notes: list[str] = field(default_factory=list)
    device_ring_bytes: int = 0
    optimizer_host_bytes: int = 0
    ranks: int = 1
    weight_bytes: int = 0
    host_memory_limit: int | None = None
    disk_bytes: int = 0
    disk_read_bytes_per_step: int = 0
    engine_host_bytes: int = 0
    host_limit_fits: bool = True
    optimizer_swap_bytes: int = 0
    trainable_host_bytes: int = 0
    whole_logits_peak_bytes: int = 0
    loss_logits: LossLogitsDecision | None = None

    @property
    def host_bytes(self) -> int:
        """Host memory the job holds besides what its device peak puts there: the pinned copies and every
        rank's CPU optimizer state."""
        return self.pinned_host_bytes + self.ranks * self.optimizer_host_bytes


# Deeper than this, a model of repeated layers is estimated from two shallower copies of it (see below).
MAX_BUILT_LAYERS = 64


def estimate_memory(spec: JobSpec) -> MemoryEstimate:
    """Estimate peak device bytes and pinned host bytes for ``spec`` (no weights are read or allocated).

    Example:
        >>> estimate = estimate_memory(load_job_spec(Path("configs/cpu_smoke.yaml").read_text()))
        >>> estimate.peak_device_bytes > 0
        True
    """
    if spec.offload.gpu_memory_budget == AUTO_BUDGET and spec.offload.enable_model_cpu_offload:
        # What auto keeps resident is what the streamed estimate leaves under the ceiling (budget.py).
        decision = decide_budget(spec)
        assert decision is not None
        estimate = estimate_memory(with_budget(spec, decision.resident_bytes or None))
        estimate.notes.append(decision.message)
        return estimate
    decided = with_mlp_tiling_decided(spec)
    layers = getattr(spec.model, "num_layers", None)
    if isinstance(layers, int) and layers > MAX_BUILT_LAYERS:
        estimate = _extrapolated(decided, layers)
    else:
        estimate = _estimate_built(decided)
    estimate = with_loss_logits_decided(decided, estimate)
    if getattr(spec.model, "tiled_mlp", None) == "auto" and decided.model.tiled_mlp:
        estimate.notes.append(
            "model.tiled_mlp auto: MLPs over tiles, as the estimate with whole ones exceeds the device"
        )
    return estimate


def with_mlp_tiling_decided(spec: JobSpec) -> JobSpec:
    """``spec`` with ``model.tiled_mlp: auto`` decided, for the estimate and for the build alike.

    Tiling costs compute (one more MLP forward a step in a layer that normalizes its MLP's output, smaller matmuls
    in one whose recompute skips the MLP: jobs/recompute/tiled_mlp.py), so ``auto`` tiles only where it is needed: the
    job checkpoints its layers and its estimate with whole MLPs (and, under ``offload.activations: auto``, without offloaded
    activations: tiling is tried first, being the one that adds no bytes to the link) exceeds
    ``offload.gpu_memory_limit`` or, without one, this process's GPU (never on a machine without one).
    """
    section: Any = spec.model
    if getattr(section, "tiled_mlp", None) != "auto":
        return spec
    tiles = False
    if spec.training.gradient_checkpointing:
        offload = _streamed(spec).offload  # an auto budget fills what is left after the tiling
        if offload.activations == "auto":
            offload = offload.model_copy(update={"activations": False})
        whole = spec.model_copy(update={"model": section.model_copy(update={"tiled_mlp": False}), "offload": offload})
        tiles = estimate_memory(whole).peak_device_bytes > (_usable_device_bytes(spec) or 2**62)
    return spec.model_copy(update={"model": section.model_copy(update={"tiled_mlp": tiles})})


def _extrapolated(spec: JobSpec, layers: int) -> MemoryEstimate:
    """The estimate of a model of ``layers`` identical layers from the ones of 32 and 64 layers.

    Even on the meta device, building a module costs time and memory per layer (``num_layers: 200000``
    took 27 s and 1 GB of a server request). Every figure grows by the same amount per layer once the
    streaming window is full, so two shallow copies give the deep one exactly (weights, gradients, states,
    activations, the pinned arena up to its chunk rounding).
    """
    low, high = MAX_BUILT_LAYERS // 2, MAX_BUILT_LAYERS
    small, large = (_estimate_built(_with_layers(spec, n)) for n in (low, high))

    def grow(a: int, b: int) -> int:
        return int(b + (b - a) * (layers - high) / (high - low))

    return MemoryEstimate(
        peak_device_bytes=grow(small.peak_device_bytes, large.peak_device_bytes),
        pinned_host_bytes=grow(small.pinned_host_bytes, large.pinned_host_bytes),
        notes=[f"{layers} layers: extrapolated from {low} and {high} layers (same layers, so it grows by layer)"],
        device_ring_bytes=large.device_ring_bytes,  # the window, full from a few layers on
        optimizer_host_bytes=grow(small.optimizer_host_bytes, large.optimizer_host_bytes),
        ranks=large.ranks,
        weight_bytes=grow(small.weight_bytes, large.weight_bytes),
        host_memory_limit=large.host_memory_limit,
        disk_bytes=grow(small.disk_bytes, large.disk_bytes),
        disk_read_bytes_per_step=grow(small.disk_read_bytes_per_step, large.disk_read_bytes_per_step),
        engine_host_bytes=(engine := grow(small.engine_host_bytes, large.engine_host_bytes)),
        host_limit_fits=large.host_memory_limit is None or engine <= large.host_memory_limit,
        optimizer_swap_bytes=grow(small.optimizer_swap_bytes, large.optimizer_swap_bytes),
        trainable_host_bytes=grow(small.trainable_host_bytes, large.trainable_host_bytes),
        whole_logits_peak_bytes=grow(small.whole_logits_peak_bytes, large.whole_logits_peak_bytes),
    )


def _with_layers(spec: JobSpec, layers: int) -> JobSpec:
    return spec.model_copy(update={"model": spec.model.model_copy(update={"num_layers": layers})})


def _estimate_built(spec: JobSpec) -> MemoryEstimate:
    model = _shapes_only_model(spec)
    lora = _lora_bytes(model, spec)  # before precomputed layers leave: their adapters stay
    family = family_of(spec.model)
    before = _tensor_bytes(model.parameters())
    if family.drop_precomputed is not None:
        family.drop_precomputed(spec, model)
    precomputed = before - _tensor_bytes(model.parameters())
    total = _tensor_bytes(model.parameters()) + _tensor_bytes(model.buffers())
    trainable = lora if spec.lora is not None else total
    offload = spec.offload
    optimizer_state = OPTIMIZER_STATES[spec.training.optimizer] * trainable
    # torch's foreach Adam(W) step allocates one temporary the size of the trainable weights.
    step_temp = trainable if spec.training.optimizer != "sgd" else 0
    activations = family.activation_bytes(spec, model)
    notes = [f"weights {_gib(total)}, trainable {_gib(trainable)}, activations {_gib(activations)}"]
    if precomputed:
        notes.append(
            f"{_gib(precomputed)} of weights precomputed once and kept on the host (model.precompute_modulation)"
        )

    ranks, optimizer_host, budget = spec.distributed.world_size, 0, 0
    plan: MemoryPlan | None = None
    if not offload.enable_model_cpu_offload:
        resident = total + lora + trainable + optimizer_state  # weights (+ adapters), gradients, state
        notes.append("no offload: weights, gradients and optimizer state all on the device")
        pinned = ring = 0
    else:
        plan = engine_plan(model, spec)
        ring = window = plan.ring_bytes
        if spec.lora is None and offload.enable_optimizer_cpu_offload:
            window += plan.largest_unit_bytes  # a unit's gradients sit on the device until copied out
        measured = offload.gpu_memory_budget == AUTO_BUDGET  # fills what the limit leaves: not in the bound
        budget = 0 if measured else min(parse_bytes(offload.gpu_memory_budget) or 0, total)
        if offload.enable_optimizer_cpu_offload:
            resident, step_temp = window + budget, 0
            notes.append(
                f"model + optimizer offload: device ring {_gib(window)} (the engine's plan: prefetch + 1 slots "
                "per repeated unit, with their gradients); trainable weights and optimizer state on the host"
            )
        else:
            resident = window + budget + 2 * trainable + optimizer_state  # weights, gradients, state
            notes.append(
                f"model offload: device ring {_gib(window)} (the engine's plan); trainable weights, gradients "
                "and optimizer state on the device"
            )
        if budget:
            notes.append(f"gpu_memory_budget keeps up to {_gib(budget)} resident")
            if plan.device_trainable_bytes:
                notes.append(
                    f"of it {_gib(plan.device_trainable_bytes)} for the first trainable weights, kept on the device "
                    "with their gradients and optimizer state (updated there, not by the CPU)"
                )
        elif measured:
            notes.append(
                "gpu_memory_budget 'auto': after two steps, weights fill what the limit leaves above their peak "
                "(this estimate is the streamed peak; the device then holds up to the limit less a margin)"
            )
        pinned = plan.pinned_reserved_bytes + plan.staging_bytes
        if spec.lora is not None and offload.enable_optimizer_cpu_offload:
            pinned += 2 * lora  # adapters and their gradients on the host (peft adds them after the base)
        needed = plan.pinned_requested_bytes
        if needed and pinned > 1.1 * needed:
            notes.append(f"pinned arena reserves {_gib(pinned)} for {_gib(needed)} of host copies (chunk rounding)")
        if offload.enable_optimizer_cpu_offload:
            optimizer_host = host_optimizer_bytes(model, spec, plan, lora)
            split = f", its 1/{ranks} part on each of {ranks} ranks" if splits_optimizer(spec) else ""
            notes.append(f"CPU optimizer state {_gib(optimizer_host)} in host memory{split}")
        if ranks > 1:
            own = own_host_bytes(model, spec, plan, lora)
            pinned += (ranks - 1) * own
            notes.append(
                f"{ranks} ranks on one machine: one host copy of the frozen weights between them, each rank's own "
                f"trainable masters, gradient buffers and buffers ({_gib(own)}) once per rank"
            )
    peak = resident + max(activations, step_temp)
    # Decided on the streamed peak: a budget (auto's above all) fills what the activations leave.
    saved = _offloaded_inputs(spec, model, peak - budget)
    if saved:
        # Held on the host from forward to the recompute: on the device, the input being recomputed and the
        # one its prefetch brings back.
        activations -= sum(saved) - 2 * max(saved)
        peak = resident + max(activations, step_temp)
        with_saved = engine_plan(model, spec, activation_host_bytes=saved)
        arena = with_saved.activation_reserved_bytes
        pinned += ranks * arena  # each rank's own
        if plan is not None and with_saved.disk_bytes:  # the host limit, shared with them, moved more to disk
            pinned += with_saved.pinned_reserved_bytes + with_saved.staging_bytes
            pinned -= plan.pinned_reserved_bytes + plan.staging_bytes
            plan = with_saved
        notes.append(
            f"offload.activations: {len(saved)} checkpointed inputs ({_gib(sum(saved))}) in pinned host memory "
            f"({_gib(arena)} reserved), two on the device"
        )
    if ranks > 1:
        notes.append(
            f"{ranks} rank processes, each holding about {_gib(RANK_PROCESS_HOST_BYTES)} of host memory besides its "
            "tensors (Python, torch, the process group): the host check adds them"
        )
    quantize = getattr(spec.model, "quantize", None)
    if quantize is not None and offload.enable_model_cpu_offload:
        notes.append(
            f"model.quantize {quantize}: the frozen linears are quantized as they load, one at a time, and held "
            "quantized in the pinned arena (the dense model is never in host memory)"
        )
    limit = parse_bytes(offload.host_memory_limit, name="offload.host_memory_limit")
    engine_host = plan.host_bytes if plan is not None else 0
    host_fits = plan.host_fits if plan is not None else limit is None
    swap = decide_optimizer_swap(spec, plan, hosted_state_tensors(model, spec, plan)) if plan is not None else None
    if plan is not None and limit is not None:
        notes.extend(disk_notes(plan, limit))
    if swap is not None:  # a full fine-tune's limit bounds its optimizer state too: in memory or its swap ring
        notes.append(swap.message)
        engine_host += swap.host_bytes
        host_fits = host_fits and limit is not None and engine_host <= limit
        optimizer_host = swap.host_bytes if swap.swap else optimizer_host
    notes.append(
        f"peak = resident {_gib(resident)} + max(activations {_gib(activations)}, optimizer step "
        f"temporaries {_gib(step_temp)}); excludes the CUDA context"
    )
    whole_logits = family.whole_logits_bytes(spec, model) if family.whole_logits_bytes is not None else None
    whole_logits_peak = resident + max(activations + whole_logits, step_temp) if whole_logits is not None else 0
    return MemoryEstimate(
        int(peak),
        int(pinned),
        notes,
        device_ring_bytes=ring,
        optimizer_host_bytes=optimizer_host,
        ranks=ranks,
        weight_bytes=total,
        host_memory_limit=limit,
        disk_bytes=plan.disk_bytes if plan is not None else 0,
        disk_read_bytes_per_step=disk_read_bytes_per_step(plan) if plan is not None else 0,
        engine_host_bytes=engine_host,
        host_limit_fits=host_fits,
        optimizer_swap_bytes=swap.swap_bytes if swap is not None and swap.swap else 0,
        trainable_host_bytes=trainable_host_bytes(model, spec, plan) if plan is not None and spec.lora is None else 0,
        whole_logits_peak_bytes=int(whole_logits_peak),
    )


def offloaded_activations(spec: JobSpec) -> tuple[int, ...]:
    """The host buffers of the checkpointed inputs ``spec`` offloads (``offload.activations``), in the order
    they are saved; empty when it does not. ``auto`` offloads when the estimate with them on the device
    exceeds ``offload.gpu_memory_limit`` or, without one, this process's GPU (never on a machine without one)."""
    family = family_of(spec.model)
    if not _offloads_at_all(spec) or family.checkpointed_inputs is None:
        return ()
    if spec.offload.activations == "auto":
        streamed = _streamed(spec)  # an auto budget fills what the activations leave: decided after them
        kept = streamed.model_copy(update={"offload": streamed.offload.model_copy(update={"activations": False})})
        if estimate_memory(kept).peak_device_bytes <= (_usable_device_bytes(spec) or 2**62):
            return ()
    return tuple(family.checkpointed_inputs(spec, _shapes_only_model(spec)))


def _streamed(spec: JobSpec) -> JobSpec:
    """``spec`` with an auto budget left out: the decisions an auto budget follows are made without it."""
    return with_budget(spec, None) if spec.offload.gpu_memory_budget == AUTO_BUDGET else spec


def _offloaded_inputs(spec: JobSpec, model: nn.Module, peak: float) -> tuple[int, ...]:
    """``offloaded_activations`` for the model being estimated, whose peak without them is ``peak``."""
    family = family_of(spec.model)
    if not _offloads_at_all(spec) or family.checkpointed_inputs is None:
        return ()
    if spec.offload.activations == "auto" and peak <= (_usable_device_bytes(spec) or 2**62):
        return ()
    return tuple(family.checkpointed_inputs(spec, model))


def _offloads_at_all(spec: JobSpec) -> bool:
    offload = spec.offload
    return (
        offload.activations is not False and offload.enable_model_cpu_offload and spec.training.gradient_checkpointing
    )


def _usable_device_bytes(spec: JobSpec) -> int | None:
    limit = parse_bytes(spec.offload.gpu_memory_limit)
    if limit is not None:
        return limit
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _shapes_only_model(spec: JobSpec) -> nn.Module:
    return family_of(spec.model).meta_model(spec.model).to(getattr(torch, spec.model.dtype))


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _lora_bytes(model: nn.Module, spec: JobSpec) -> int:
    if spec.lora is None:
        return 0
    total = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        targeted = any(lora_target_matches(name, target) for target in spec.lora.target_modules)
        if targeted and weight is not None and weight.dim() == 2:
            total += spec.lora.rank * sum(weight.shape) * _LORA_BYTES
    return total


def engine_plan(model: nn.Module, spec: JobSpec, *, activation_host_bytes: tuple[int, ...] = ()) -> MemoryPlan:
    """The offload engine's own memory plan for ``spec``'s model (``offload.plan_memory``, the function the
    engine builds itself from). Under LoRA the base model is frozen, as peft leaves it. ``activation_host_bytes``:
    the checkpointed inputs it offloads (``offloaded_activations``), whose pinned arena the plan sizes."""
    if spec.lora is not None:
        model.requires_grad_(False)
    offload = spec.offload
    quantize = getattr(spec.model, "quantize", None)
    # A quantized base: the stored bytes in the arena and the ring, and rooms for NF4 dequantized on arrival.
    arrival = offload.dequantize_on_arrival
    sizes = planned_sizes(model, quantize, dequantize_on_arrival=arrival) if quantize is not None else {}
    whole = family_of(spec.model).whole_units  # as the session gives them to the engine (a frozen vision tower)
    return plan_memory(
        model,
        enable_optimizer_cpu_offload=offload.enable_optimizer_cpu_offload,
        cpu_offload_split_threshold=offload.cpu_offload_split_threshold,
        # The job's own options (with optimizer offload a set budget keeps the first trainables on the device,
        # with no host copies), over a dry-run arena.
        options=offload.engine_options(
            pin_memory=False,
            offload_activations=bool(activation_host_bytes),
            activation_host_bytes=activation_host_bytes,
            whole_units=whole(model) if whole is not None else (),
        ),
        optimizer_shard=rank_shard(spec),  # the ranks split the CPU optimizer: rank 0's gradient buffers
        disk=disk_locator(spec),  # offload.host_memory_limit: frozen weights beyond it read from their files
        **sizes,
    )


_gib = human_bytes  # the notes' sizes
