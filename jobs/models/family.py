"""`ModelFamily`: everything Ferry knows about one kind of model, in one registry entry.

Like torchtitan's ``TrainSpec``, an entry bundles what the rest of the code would otherwise learn through
``if kind == ...`` branches: the spec section, how to build the model and its loss, which data it trains
on, how the fit check sizes it (shapes-only model, activation formula), which names LoRA can target, how
gradient checkpointing is switched on, and how its trainable weights are written into a checkpoint.
Entries are listed in jobs/models/registry.py; docs/model-families.md shows how to add one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import torch
from torch import nn

from jobs.checkpoints.weights import TRAINABLE_SAFETENSORS, WeightsFormat
from jobs.errors import Problem
from jobs.models.loading.weight_sources import WeightSource
from jobs.spec.sections import Section

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec

JobT = TypeVar("JobT", bound="JobSpec")  # the job as a family's callbacks see it, with its own sections
LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ModelFamily(Generic[JobT]):
    """One model family: its spec section and every per-family decision the jobs package makes.

    Attributes:
        kind: The ``model.kind`` value that selects it; equal to ``spec``'s ``kind`` literal.
        spec: The pydantic section of ``model:`` (a `Section` with ``kind: Literal[<kind>]``).
        build: ``build(model_spec, seed) -> nn.Module`` on the CPU in the spec's dtype.
        loss: ``loss(model, batch) -> scalar tensor`` for one micro-batch.
        data_kinds: The ``data.kind`` values it trains on (the first is named in the error).
        meta_model: ``meta_model(model_spec) -> nn.Module`` on the meta device (shapes and names, no
            memory): what the fit check and LoRA target check look at. May read a config file.
        activation_bytes: ``activation_bytes(job_spec, meta_model) -> int``: bytes of activations kept
            for backward at the peak of one micro-batch (the fit check's only per-family formula).
        lora_target_names: ``names(model_spec) -> list[str] | None``: the Linear modules LoRA may
            target, checked at submit time; None when they are known only once the model is loaded.
        module_names_from_files: ``names(model_spec) -> {name: LoRA can wrap it}``: every module name, read
            from the model's files (a ``config.json``) at submit time by jobs/spec/preflight.py, for families
            whose ``lora_target_names`` is None; LoRA targets matching none of them, or matching a module LoRA
            cannot wrap (a container, a layer index), are refused before queueing.
        peft_task_type: peft's ``task_type`` for LoRA (``"CAUSAL_LM"`` lets peft's Auto classes load it).
        enable_gradient_checkpointing: Turns activation checkpointing on for a built model; None when
            the family does not support it (``training.gradient_checkpointing: true`` is then refused).
        weights_format: How a checkpoint stores and reloads the trainable weights.
        rules: Extra cross-section checks for this family, each returning its (path, message) problems.
        shrink_hint: The setting the out-of-memory advice names when every offload setting is on.
        synthetic_width: ``width(model_spec)`` of synthetic regression inputs, for families trained on it.
        keeps_packed_documents_apart: The model takes position ids that restart per document, so packed
            sequences need no mask between documents (``data.packing: packed`` is refused otherwise).
        apply_lora: ``apply_lora(model, lora_spec) -> nn.Module``; None: peft's ``get_peft_model`` (jobs/models/lora.py).
        build_data: ``build_data(job_spec, device, model) -> BatchSource`` for data only this family reads
            (its batches may need the family's own encoders, or values precomputed from the built model's
            frozen layers); None: jobs.data.build_data.
        make_sampler: ``make_sampler(job_spec, device) -> Sampler | None``: what writes samples into each
            checkpoint (``sampler.write(model, directory) -> [file names]``, ``sampler.close()``).
        tasks: Jobs other than training this family runs, by ``task:`` name:
            ``run(job_spec, device=, report=, should_stop=) -> (status, step)``.
        drop_precomputed: ``drop_precomputed(job_spec, meta_model)`` removes, for the fit check, the layers whose
            outputs the job computes once before training and keeps on the host (the DiT's modulation table), or
            regroups those it streams apart (Flux.1's modulation), so the check sizes what the device holds and
            the engine streams; None: nothing is precomputed.
        data_specs: The ``data:`` sections only this family reads (each a `Section` with its own ``kind``),
            added to the job spec's data union after the shared ones.
        job_sections: Top-level job sections this family adds, ``name -> (annotation, pydantic Field)``.
        training_fields: Fields this family adds to ``training:``, ``name -> (annotation, pydantic Field)``.
        section_rules: ``rule(job_spec, job_family)``: checks of the family's own ``job_sections`` that run for
            every job, whatever its model (another family's job may still give the section), each returning its
            (path, message) problems; ``job_family`` is the entry of the job's own ``model.kind``.
        task_help: A line of help per name of ``tasks``, shown in the ``task`` field's description.
        apply_kernels: ``apply_kernels(model) -> [kernel names]``: swaps the built model's layers for fused
            kernels (``training.kernels: liger``, jobs/models/fused_kernels.py), on CUDA only; None: the family has
            none and the plain path runs.
        build_on_meta: ``build_on_meta(model_spec, seed, device) -> (meta model, WeightSource)``: the model
            with its weights on the meta device and the source that fills the offload engine's pinned host
            copies directly (jobs/models/loading/weight_sources.py); None when the family can only be built in memory.
        adapts_on_meta: ``adapts_on_meta(job_spec) -> bool``: whether the family's own ``apply_lora`` adapts this
            job's model built by ``build_on_meta`` (it reads no frozen weight's values: adapters only, no module
            copied to train in full), so LoRA jobs load into pinned memory too; None: it may read them, and a
            LoRA job of a family with its own ``apply_lora`` builds in memory.
        checkpoint_problems: ``checkpoint_problems(model_spec) -> [(tensor, file, message)]``: the ways the
            checkpoint fails to fill the model, read from the files' headers at submit time (missing,
            unexpected, misshapen tensors); None when the family has no such check.
        exports: The formats of the job spec's ``export:`` section this family's checkpoints can be written
            in (``gguf``: llama.cpp's file; ``merged``: a LoRA adapter merged into a full Hugging Face model).
        checkpointed_inputs: ``checkpointed_inputs(job_spec, meta_model) -> [bytes, ...]``: what gradient
            checkpointing keeps from forward to backward, one entry per checkpointed call in the order they are
            saved (a decoder's block inputs); ``offload.activations`` plans their pinned host memory from it.
            None: the family's activations are not offloaded.
        whole_logits_bytes: ``whole_logits_bytes(job_spec, meta_model) -> int | None``: how much more
            ``activation_bytes`` would be with the loss's logits made all at once rather than chunk by chunk (None
            where the loss would make them at once anyway); the fit check keeps them whole where that fits the
            device (jobs/fit/loss_logits.py) and the job's loss does as it decided. None: the family's loss does
            not choose.
        whole_units: ``whole_units(model) -> (module name, ...)``: modules the offload engine streams as one unit
            each, whatever ``offload.granularity`` (a frozen vision tower, run once a step); None: none.
        make_text_samples: ``make_text_samples(job_spec, device)``: what answers ``text_samples.prompts`` for data
            only this family reads, ``.generate(model) -> [{prompt, completion}]`` (and, where prompts show
            images, ``.thumbnails(directory) -> [file name or None]``, one per prompt, named by its sample
            events); None: the text data's tokenizer does (jobs/evaluate/text_samples.py).
        holds_out_eval: ``build_data`` holds out the ``eval`` section's rows itself (``eval.split`` or
            ``eval.path``), as the ``eval`` attribute of the batches it returns (``batches_per_epoch``,
            ``in_order(i)``); False: only text data is evaluated.
    """

    kind: str
    spec: type[Section]
    build: Callable[[Any, int], nn.Module]
    loss: LossFn
    data_kinds: tuple[str, ...]
    meta_model: Callable[[Any], nn.Module]
    activation_bytes: Callable[[JobT, nn.Module], int]
    lora_target_names: Callable[[Any], list[str] | None]
    module_names_from_files: Callable[[Any], Mapping[str, bool]] | None = None
    peft_task_type: str | None = None
    enable_gradient_checkpointing: Callable[[nn.Module], None] | None = None
    weights_format: WeightsFormat = TRAINABLE_SAFETENSORS
    rules: tuple[Callable[[JobT], list[Problem]], ...] = ()
    shrink_hint: str = "data.seq_len"
    synthetic_width: Callable[[Any], int] | None = None
    keeps_packed_documents_apart: bool = False
    apply_lora: Callable[[nn.Module, Any], nn.Module] | None = None
    build_data: Callable[[JobT, torch.device, nn.Module], Any] | None = None
    make_sampler: Callable[[JobT, torch.device], Any] | None = None
    tasks: Mapping[str, Callable[..., tuple[Literal["succeeded", "paused", "cancelled"], int]]] = field(
        default_factory=dict
    )
    drop_precomputed: Callable[[JobT, nn.Module], None] | None = None
    build_on_meta: Callable[[Any, int, torch.device], tuple[nn.Module, WeightSource]] | None = None
    adapts_on_meta: Callable[[JobT], bool] | None = None
    checkpoint_problems: Callable[[Any], list[tuple[str, str, str]]] | None = None
    checkpointed_inputs: Callable[[JobT, nn.Module], list[int]] | None = None
    whole_logits_bytes: Callable[[JobT, nn.Module], int | None] | None = None
    data_specs: tuple[type[Section], ...] = ()
    job_sections: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)
    training_fields: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)
    section_rules: tuple[Callable[[JobSpec, ModelFamily[Any]], list[Problem]], ...] = ()
    task_help: Mapping[str, str] = field(default_factory=dict)
    exports: frozenset[str] = frozenset()
    apply_kernels: Callable[[nn.Module], list[str]] | None = None
    whole_units: Callable[[nn.Module], tuple[str, ...]] | None = None
    make_text_samples: Callable[[JobT, torch.device], Any] | None = None
    holds_out_eval: bool = False

    def __post_init__(self) -> None:
        declared = self.spec.model_fields["kind"].annotation
        assert getattr(declared, "__args__", (None,))[0] == self.kind, f"{self.spec.__name__}.kind != {self.kind!r}"


def linear_module_names(model: nn.Module) -> list[str]:
    """Names of the Linear modules of ``model`` (the ones LoRA can target)."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def activation_element_size(spec: JobSpec) -> int:
    """Bytes per activation element: 2 under mixed precision or a half-precision model, else 4."""
    return 2 if spec.training.mixed_precision != "no" or getattr(spec.model, "dtype", "float32") != "float32" else 4


def lora_target_matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of target names: the whole name, or its last dotted components."""
    return module_name == target or module_name.endswith("." + target)
