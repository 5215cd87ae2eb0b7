"""Turn a device out-of-memory error into advice naming the setting that would help."""

from __future__ import annotations

from jobs.models.registry import family_of
from jobs.spec.job import JobSpec
from offload import parse_bytes
from offload.options import AUTO_BUDGET


def oom_advice(spec: JobSpec) -> str:
    """The first setting, in order of expected saving, that is not yet used."""
    offload, training = spec.offload, spec.training
    family = family_of(spec.model)
    if not offload.enable_model_cpu_offload:
        return "set offload.enable_model_cpu_offload: true to keep the weights on the CPU and stream them"
    # Asked for: measured on steps 1-2 and a later step needed more. The default (also auto) goes down the
    # ladder: its choice is in the job's events, and the settings below save more.
    if offload.gpu_memory_budget == AUTO_BUDGET and "gpu_memory_budget" in offload.model_fields_set:
        return "set offload.gpu_memory_budget to a size below what 'auto' chose (job.log) or remove it to stream every unit"
    if offload.gpu_memory_budget not in (None, AUTO_BUDGET):
        return f"lower offload.gpu_memory_budget (now {offload.gpu_memory_budget}) or remove it to stream every unit"
    if spec.lora is None and not offload.enable_optimizer_cpu_offload:
        return "set offload.enable_optimizer_cpu_offload: true to keep trainable weights and optimizer state on the CPU"
    if family.enable_gradient_checkpointing is not None and not training.gradient_checkpointing:
        return "set training.gradient_checkpointing: true to recompute activations instead of keeping them"
    if not offload.enable_optimizer_cpu_offload:
        return "set offload.enable_optimizer_cpu_offload: true to keep trainable weights and optimizer state on the CPU"
    if offload.prefetch > 1:
        return f"lower offload.prefetch (now {offload.prefetch}) so fewer units are on the device at once"
    if training.batch_size > 1:
        return f"lower training.batch_size (now {training.batch_size})"
    return f"every offload setting is on and the batch is 1; lower {family.shrink_hint}"


def oom_message(spec: JobSpec, step: int, error: BaseException) -> str:
    """The message of the OutOfMemoryHint raised in place of a CUDA out-of-memory error.

    Under ``offload.gpu_memory_limit`` the message says so first: the card may have room, the limit did not,
    so raising the limit is one of the ways out.
    """
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    limit = spec.offload.gpu_memory_limit
    if limit is None:
        return f"device out of memory at step {step + 1}: {first_line}. To fit: {oom_advice(spec)}."
    return (
        f"device out of memory at step {step + 1} under offload.gpu_memory_limit={limit} "
        f"({(parse_bytes(limit) or 0) / 2**30:.2f} GiB for this process): {first_line}. To fit: {oom_advice(spec)}, "
        f"or raise offload.gpu_memory_limit."
    )
