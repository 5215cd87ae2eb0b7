"""Rules that span spec sections. Each returns the problems it finds so all are reported together.

Per-family knowledge (which data a model trains on, its LoRA names, gradient checkpointing, extra rules)
comes from the model's registry entry (jobs/models/registry.py), never from a ``kind ==`` branch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobs.errors import Problem
from jobs.models.names import lora_target_matches
from jobs.models.registry import FAMILIES, family_of
from jobs.spec.rules_llm import RULES as LLM_RULES

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec


def _check_data_fits_model(spec: JobSpec) -> list[Problem]:
    wanted = family_of(spec.model).data_kinds
    if spec.data.kind not in wanted:
        return [
            (
                "data.kind",
                f"model.kind={spec.model.kind} trains on data.kind={' or '.join(wanted)}; got {spec.data.kind}",
            )
        ]
    return []


def _check_epochs_need_finite_data(spec: JobSpec) -> list[Problem]:
    if spec.training.epochs is not None and spec.data.kind == "synthetic_regression":
        return [("training.epochs", "synthetic_regression has no end; use training.steps instead")]
    return []


def _check_lora_targets_exist(spec: JobSpec) -> list[Problem]:
    if spec.lora is None:
        return []
    names = family_of(spec.model).lora_target_names(spec.model)
    if names is None:  # e.g. a Hugging Face model: its names are known only once loaded
        return []
    missing = [t for t in spec.lora.target_modules if not any(lora_target_matches(n, t) for n in names)]
    if missing:
        examples = ", ".join(sorted({_without_block_index(n) for n in names})[:12])
        return [
            (
                "lora.target_modules",
                f"{missing} match no Linear module of {spec.model.kind} (names end in e.g.: {examples})",
            )
        ]
    return []


def _without_block_index(name: str) -> str:
    """``blocks.3.attn.to_q`` → ``attn.to_q``: one example per kind of module."""
    parts = name.split(".")
    return ".".join(parts[2:]) if len(parts) > 2 and parts[1].isdigit() else name


def _check_checkpointing_supported(spec: JobSpec) -> list[Problem]:
    if spec.training.gradient_checkpointing and family_of(spec.model).enable_gradient_checkpointing is None:
        return [("training.gradient_checkpointing", f"{spec.model.kind} does not support it; set it to false")]
    return []


def _check_precision_fits_device(spec: JobSpec) -> list[Problem]:
    if spec.device == "cpu" and spec.training.mixed_precision == "fp16":
        return [("training.mixed_precision", "fp16 needs a CUDA device; use bf16 or no with device: cpu")]
    return []


def _check_warmup_fits_steps(spec: JobSpec) -> list[Problem]:
    steps, warmup = spec.training.steps, spec.training.scheduler.warmup_steps
    if steps is not None and warmup > steps:
        return [("training.scheduler.warmup_steps", f"must be <= training.steps ({steps}); got {warmup}")]
    return []


def _check_task_supported(spec: JobSpec) -> list[Problem]:
    family = family_of(spec.model)
    problems = []
    if spec.task == "train" and spec.training.steps is None and spec.training.epochs is None:
        problems.append(("training.steps", "give exactly one of training.steps and training.epochs"))
    if spec.task != "train" and spec.task not in family.tasks:
        problems.append(("task", f"model.kind={spec.model.kind} has no task {spec.task!r}; use task: train"))
    return problems


def _check_delayed_update_without_clipping(spec: JobSpec) -> list[Problem]:
    if spec.offload.delayed_update and spec.training.max_grad_norm is not None:
        return [
            (
                "offload.delayed_update",
                "cannot be combined with training.max_grad_norm (a global norm needs every gradient before "
                "any update); set one of them off",
            )
        ]
    return []


def _check_quantize_needs_a_frozen_base(spec: JobSpec) -> list[Problem]:
    if getattr(spec.model, "quantize", None) is not None and spec.lora is None:
        return [
            (
                "model.quantize",
                "quantizes the frozen base weights under LoRA adapters (QLoRA); add a lora section or remove it",
            )
        ]
    return []


def _check_activation_offload_needs_checkpointing(spec: JobSpec) -> list[Problem]:
    if spec.offload.activations is True and not spec.training.gradient_checkpointing:
        return [
            (
                "offload.activations",
                "offloads what gradient checkpointing keeps; set training.gradient_checkpointing: true or turn it off",
            )
        ]
    return []


def _check_uncheckpointed_layers_need_checkpointing(spec: JobSpec) -> list[Problem]:
    if getattr(spec.model, "uncheckpointed_layers", 0) and not spec.training.gradient_checkpointing:
        return [
            (
                "model.uncheckpointed_layers",
                "keeps layers out of gradient checkpointing, which is off; set training.gradient_checkpointing: "
                "true or remove it",
            )
        ]
    return []


def _check_compile_runs_outside_the_engine_hooks(spec: JobSpec) -> list[Problem]:
    offload = spec.offload
    if spec.training.compile and offload.enable_model_cpu_offload and offload.granularity == "leaf":
        return [
            (
                "training.compile",
                "with offload.enable_model_cpu_offload the engine's leaf units hook every layer inside a compiled "
                "block; set offload.granularity: block (the engine then hooks the block, outside what is compiled)",
            )
        ]
    return []


def _check_distributed_trains(spec: JobSpec) -> list[Problem]:
    if spec.distributed.world_size > 1 and spec.task != "train":
        return [("distributed.world_size", f"data parallelism trains; task {spec.task!r} runs on one rank: set 1")]
    return []


def _check_exports_supported(spec: JobSpec) -> list[Problem]:
    family = family_of(spec.model)
    problems: list[Problem] = []
    for name in spec.export.formats():
        if name not in family.exports:
            can = f"its exports: {', '.join(sorted(family.exports))}" if family.exports else "it has none"
            problems.append(
                (
                    f"export.{name}",
                    f"model kind {family.kind!r} cannot be exported as {name} ({can}); remove export.{name}",
                )
            )
    if spec.export.merged and spec.lora is None and "merged" in family.exports:
        problems.append(
            ("export.merged", "a full fine-tune's checkpoint is already a whole model: remove export.merged")
        )
    if spec.export.formats() and not spec.checkpoint.save_final and spec.checkpoint.every_steps is None:
        problems.append(("export", "exports are written from a checkpoint: set checkpoint.save_final: true"))
    return problems


RULES = (
    _check_task_supported,
    _check_distributed_trains,
    _check_data_fits_model,
    _check_epochs_need_finite_data,
    _check_lora_targets_exist,
    _check_checkpointing_supported,
    _check_precision_fits_device,
    _check_warmup_fits_steps,
    _check_delayed_update_without_clipping,
    _check_activation_offload_needs_checkpointing,
    _check_uncheckpointed_layers_need_checkpointing,
    _check_compile_runs_outside_the_engine_hooks,
    _check_quantize_needs_a_frozen_base,
    _check_exports_supported,
    *LLM_RULES,
)


def cross_section_problems(spec: JobSpec) -> list[Problem]:
    """Every cross-section problem of ``spec``; empty when the combination is valid.

    `load_job_spec` runs this over the built spec and reports its problems with the fields' own. The rules:
    the shared ones above, every family's rules over the sections it adds to any job, then the rules of the
    job's own family.
    """
    family = family_of(spec.model)
    problems = [problem for rule in RULES for problem in rule(spec)]
    sections = [
        problem for owner in FAMILIES.values() for rule in owner.section_rules for problem in rule(spec, family)
    ]
    return problems + sections + [problem for rule in family.rules for problem in rule(spec)]
