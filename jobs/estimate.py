"""A fit check before queueing: peak device memory and pinned host memory, without loading any weight.

The model is built on the meta device (shapes only) and the offload engine's own unit discovery cuts it
into units, so the streaming window is the engine's, not a guess. Activations follow the model family's
own formula (``ModelFamily.activation_bytes``, e.g. per-layer terms for decoder LMs). The device number is what
``torch.cuda.max_memory_allocated`` should report; the CUDA context (~0.5 GiB) and allocator slack come on
top of it in ``nvidia-smi``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from jobs.models.names import lora_target_matches
from jobs.models.registry import family_of
from jobs.spec import JobSpec
from offload import discover_units, parse_bytes
from offload.arena import _align, plan_chunk_size

_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}
_LORA_BYTES = 4  # peft keeps adapters in float32 even on a bf16 base model (autocast_adapter_dtype)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated memory for a job.

    Attributes:
        peak_device_bytes: Peak bytes allocated by PyTorch on the device.
        pinned_host_bytes: Page-locked host bytes the offload engine reserves (0 without model offload).
        notes: How the numbers were reached, largest contributions first.
    """

    peak_device_bytes: int
    pinned_host_bytes: int
    notes: list[str] = field(default_factory=list)


def estimate_memory(spec: JobSpec) -> MemoryEstimate:
    """Estimate peak device bytes and pinned host bytes for ``spec`` (no weights are read or allocated).

    Example:
        >>> estimate = estimate_memory(load_job_spec(Path("configs/cpu_smoke.yaml").read_text()))
        >>> estimate.peak_device_bytes > 0
        True
    """
    model = _shapes_only_model(spec)
    total = _tensor_bytes(model.parameters()) + _tensor_bytes(model.buffers())
    lora = _lora_bytes(model, spec)
    trainable = lora if spec.lora is not None else total
    offload = spec.offload
    optimizer_state = _OPTIMIZER_STATES[spec.training.optimizer] * trainable
    # torch's foreach Adam(W) step allocates one temporary the size of the trainable weights.
    step_temp = trainable if spec.training.optimizer != "sgd" else 0
    activations = family_of(spec.model).activation_bytes(spec, model)
    notes = [f"weights {_gib(total)}, trainable {_gib(trainable)}, activations {_gib(activations)}"]

    if not offload.enable_model_cpu_offload:
        resident = total + lora + trainable + optimizer_state  # weights (+ adapters), gradients, state
        notes.append("no offload: weights, gradients and optimizer state all on the device")
        pinned = 0
    else:
        streamed = _streamed(model, spec)
        window = _streaming_window(model, spec, streamed)
        budget = min(parse_bytes(offload.gpu_memory_budget) or 0, total)
        if offload.enable_optimizer_cpu_offload:
            resident, step_temp = window + budget, 0
            notes.append(
                f"model + optimizer offload: streaming window {_gib(window)} (units in flight, with "
                "their gradients); trainable weights and optimizer state on the host"
            )
        else:
            resident = window + budget + 2 * trainable + optimizer_state  # weights, gradients, state
            notes.append(
                f"model offload: streaming window {_gib(window)}; trainable weights, gradients and "
                "optimizer state on the device"
            )
        if budget:
            notes.append(f"gpu_memory_budget keeps up to {_gib(budget)} resident")
        pinned = _pinned_bytes(model, spec, streamed)
        needed = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if id(t) in streamed)
        if needed and pinned > 1.1 * needed:
            notes.append(f"pinned arena reserves {_gib(pinned)} for {_gib(needed)} of host copies (chunk rounding)")
    peak = resident + max(activations, step_temp)
    notes.append(
        f"peak = resident {_gib(resident)} + max(activations {_gib(activations)}, optimizer step "
        f"temporaries {_gib(step_temp)}); excludes the CUDA context"
    )
    return MemoryEstimate(int(peak), int(pinned), notes)


def _shapes_only_model(spec: JobSpec) -> nn.Module:
    return family_of(spec.model).meta_model(spec.model).to(getattr(torch, spec.model.dtype))


def _tensor_bytes(tensors: object) -> int:
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


def _streamed(model: nn.Module, spec: JobSpec) -> set[int]:
    """ids of the tensors the engine streams: frozen weights and buffers, and trainable weights too under
    optimizer offload (with full fine-tuning and no optimizer offload every weight stays on the device)."""
    full_training = spec.lora is None
    streams_trainable = spec.offload.enable_optimizer_cpu_offload
    return {id(b) for b in model.buffers()} | {
        id(p) for p in model.parameters() if not full_training or streams_trainable
    }


def _plans(model: nn.Module, spec: JobSpec) -> list:
    """The engine's own cut of the model into units (a threshold overrides block granularity, as there)."""
    threshold = spec.offload.cpu_offload_split_threshold
    if threshold is not None:
        return discover_units(model, int(threshold * 2**20), "leaf")
    return discover_units(model, None, spec.offload.granularity)


def _streaming_window(model: nn.Module, spec: JobSpec, streamed: set[int]) -> int:
    """Device bytes of the units in flight, following the engine's schedule over its units in forward order:
    the unit computing plus ``prefetch`` units ahead (the largest such run), plus the last unit of forward,
    which the engine keeps for the start of backward."""
    units = [
        sum(t.numel() * t.element_size() for _, t in plan.tensors if id(t) in streamed) for plan in _plans(model, spec)
    ]
    units = [u for u in units if u] or [0]
    run = spec.offload.prefetch + 1
    window = max(sum(units[i : i + run]) for i in range(len(units)))
    kept = units[-1] if spec.offload.prefetch > 0 else 0
    # Under full fine-tuning with optimizer offload a unit's gradients sit on the device until copied out.
    grads = max(units) if spec.lora is None and spec.offload.enable_optimizer_cpu_offload else 0
    return window + kept + grads


def _pinned_bytes(model: nn.Module, spec: JobSpec, streamed: set[int]) -> int:
    """Replay the engine's arena over its host copies, in the engine's order: unit by unit, largest tensor
    first (a block unit as one span), a trainable tensor's host gradient buffer after it (optimizer offload)."""
    sizes, seen = [], set()
    grads_on_host = spec.lora is None and spec.offload.enable_optimizer_cpu_offload
    for plan in _plans(model, spec):
        ordered = sorted(plan.tensors, key=lambda nt: -nt[1].numel() * nt[1].element_size())
        new = [t for _, t in ordered if id(t) not in seen and id(t) in streamed]
        seen.update(id(t) for t in new)
        nbytes = [max(1, t.numel()) * t.element_size() for t in new]
        flat = getattr(plan, "flat", False) and len(new) > 1
        if flat:
            sizes.append(sum(_align(n) for n in nbytes))
        for tensor, n in zip(new, nbytes, strict=True):
            trainable = isinstance(tensor, nn.Parameter) and grads_on_host
            sizes += ([] if flat else [n]) + ([n] if trainable else [])
    if spec.lora is not None and spec.offload.enable_optimizer_cpu_offload:
        sizes += [_lora_bytes(model, spec)] * 2  # adapters and their gradients (summed: they are tiny)
    return _arena_reserved(sizes)


def _arena_reserved(sizes: list[int]) -> int:
    """Bytes PinnedArenaPool reserves for allocations of ``sizes`` in this order (offload/arena.py)."""
    remaining, chunks = sum(_align(size) for size in sizes), []  # chunks: [capacity, used]
    for size in sizes:
        chunk = next((c for c in chunks if c[0] - c[1] >= size), None)
        if chunk is None:
            chunk = [plan_chunk_size(_align(size), max(remaining, 0)), 0]
            chunks.append(chunk)
        chunk[1] += _align(size)
        remaining -= _align(size)
    return sum(capacity for capacity, _ in chunks)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
