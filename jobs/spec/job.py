"""The job spec: pydantic models that mirror the YAML sections. `load_job_spec` (loading.py) builds them.

Components are picked by ``kind`` from a closed set (discriminated unions), never by an import path:
specs arrive over HTTP and must not name code to run. Field-level rules live on the sections as
``_check_*`` validators; rules that span sections are the ``_check_*`` functions of rules.py, which
`load_job_spec` runs over the built spec so that every violation is reported together.

This module names no model family: ``model:``, the family-only data kinds, the families' extra sections
(``cache:``, ``sample:``, ...) and ``training:`` fields and their tasks are assembled from the registry
(jobs/models/registry.py), each family contributing through its `ModelFamily` entry.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationInfo, create_model, field_validator, model_validator

from jobs.models import registry
from jobs.spec.distributed import DistributedSpec
from jobs.spec.llm import DPOSpec, EvalSpec, GRPOSpec, InstructionFields, ORPOSpec, TextSamplesSpec, TrackingSpec
from jobs.spec.sections import DataPath, ModelPath, Section, broken_rules
from jobs.spec.sections import Dtype as Dtype
from offload import OffloadOptions
from offload import parse_bytes as parse_bytes
from offload.options import AUTO_BUDGET

# Bounds a run can hold: a step counter and a sample count (steps x batch) stay far inside int64.
MAX_STEPS = 1_000_000_000
MAX_BATCH = 1_048_576

# ---- model -------------------------------------------------------------------------------------------
# Each model family defines its own section next to its builder (jobs/models/<kind>.py); ``model:`` accepts
# any registered family's (jobs/models/registry.py). The type checker sees the sections' common base.
if TYPE_CHECKING:
    ModelSpec = Any
else:
    ModelSpec = registry.model_spec_annotation()


# ---- data --------------------------------------------------------------------------------------------
class SyntheticRegressionSpec(Section):
    """The seed's data: x ~ N(0, 1) of the model's width, target y = x + offset; one fresh batch per step."""

    kind: Literal["synthetic_regression"]
    offset: float = 1.0


class ByteTokenizerSpec(Section):
    """Built-in byte-level tokenizer: UTF-8 bytes are ids 0-255, 256 ends a document (vocabulary 257)."""

    kind: Literal["byte"]


class HFTokenizerSpec(Section):
    """A Hugging Face tokenizer from a local directory under a model root (often the model's own)."""

    kind: Literal["hf"]
    path: ModelPath


class DataSourceSpec(Section):
    """One file or directory of a ``data.mix``, and its share of the mixed records."""

    path: DataPath = Field(description="a file or a directory of data files under a data root")
    weight: float = Field(
        1.0, gt=0, le=1_000_000, description="its share of each epoch's records, relative to the others"
    )


class TextDataSpec(Section):
    """Records read through ``datasets`` (JSONL, JSON, CSV, Parquet, text files, a ``save_to_disk`` directory)
    from ``path`` or from the sources of ``mix``, tokenized as ``format`` says and packed or padded into
    sequences of at most ``seq_len`` tokens."""

    kind: Literal["text"]
    path: DataPath | None = Field(None, description="a file or a directory of data files under a data root")
    mix: list[DataSourceSpec] | None = Field(
        None, min_length=1, max_length=64, description="instead of path: several sources mixed by weight"
    )
    format: Literal["text", "instruction", "chat", "preference", "prompt"] = Field(
        "text",
        description="text: every token trains; instruction/chat: only responses unless train_on_prompt; "
        "preference: prompt, chosen and rejected (TRL's or OpenAI's DPO layout) for training.objective dpo/orpo; "
        "prompt: prompt-only rows (TRL's, standard or conversational) for training.objective grpo",
    )
    file_type: Literal["auto", "jsonl", "json", "csv", "parquet", "txt", "saved"] = Field(
        "auto", description="auto: from the suffix (a directory saved by datasets.save_to_disk is 'saved')"
    )
    text_field: str = "text"
    fields: InstructionFields = InstructionFields()
    prompt_template: str | None = Field(
        None, description="instruction prompt with {instruction} and {input}; default: alpaca's"
    )
    messages_field: str = "messages"
    chat_template: str | None = Field(None, description="a Jinja chat template, or 'chatml'; default: the tokenizer's")
    train_on_prompt: bool = False
    packing: Literal["auto", "packed", "padded"] = Field(
        "auto", description="auto: packed where the model keeps documents apart, else length-grouped padding"
    )
    seq_len: int = Field(512, gt=1)
    tokenizer: Annotated[ByteTokenizerSpec | HFTokenizerSpec, Field(discriminator="kind")] = ByteTokenizerSpec(
        kind="byte"
    )

    @model_validator(mode="before")
    @classmethod
    def _accept_old_format_names(cls, data: Any) -> Any:
        # Before chat and instruction data, ``format`` named the file type (auto | jsonl | text).
        if isinstance(data, dict) and data.get("format") in ("auto", "jsonl"):
            old = data["format"]
            data = {**data, "format": "text"}
            if old == "jsonl":
                data.setdefault("file_type", "jsonl")
        return data

    @model_validator(mode="after")
    def _check_path_or_mix(self) -> TextDataSpec:
        if (self.path is None) == (self.mix is None):
            raise broken_rules([("path", "give exactly one of data.path and data.mix (a list of {path, weight})")])
        return self

    def sources(self) -> list[tuple[str, Path, float]]:
        """(setting, path, weight) of each source: ``data.path`` alone, or each ``data.mix`` entry."""
        if self.mix is None:
            assert self.path is not None  # _check_path_or_mix
            return [("data.path", self.path, 1.0)]
        return [(f"data.mix.{index}.path", source.path, source.weight) for index, source in enumerate(self.mix)]


# The data kinds every family may share; a family adds the kinds only it reads (``ModelFamily.data_specs``).
SHARED_DATA_SPECS = (SyntheticRegressionSpec, TextDataSpec)
if TYPE_CHECKING:  # a family's own kinds: its job type (e.g. DiffusionJobSpec) narrows ``data`` to them
    DataSpec = SyntheticRegressionSpec | TextDataSpec
else:
    DataSpec = registry.data_spec_annotation(SHARED_DATA_SPECS)


# ---- lora, training, offload, checkpoint -------------------------------------------------------------
class LoraSpec(Section):
    """LoRA adapters through peft, as in the seed's example (``--lora_target_modules``, ``--lora_rank``)."""

    target_modules: list[str] = Field(min_length=1)
    rank: int = Field(32, gt=0)
    alpha: float | None = Field(None, gt=0, description="default: equal to rank")
    dropout: float = Field(0.0, ge=0, lt=1)
    use_dora: bool = False
    use_rslora: bool = Field(False, description="scale by alpha/sqrt(rank) instead of alpha/rank")
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained in full, e.g. lm_head")
    init_lora_weights: bool | Literal["gaussian"] = True


class SchedulerSpec(Section):
    """Learning-rate schedule after a linear warmup from 0."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)


class TrainingSpec(Section):
    """How long and how to optimize. Give exactly one of ``steps`` and ``epochs``."""

    steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="optimizer steps")
    epochs: int | None = Field(
        None, gt=0, le=1_000_000, description="passes over a finite dataset; auto: chosen from the data at submit"
    )
    batch_size: int = Field(1, gt=0, le=MAX_BATCH, description="auto: the largest the data fills, chosen at submit")
    auto: list[Literal["batch_size", "epochs"]] = Field(
        [],
        description="the fields given as auto, which jobs/data/auto_size.py chooses from the data before the job "
        "runs (empty once chosen)",
    )
    gradient_accumulation_steps: int = Field(1, gt=0, le=MAX_BATCH)
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    scheduler: SchedulerSpec = SchedulerSpec()
    max_grad_norm: float | None = Field(None, gt=0, description="clip gradients to this norm; null = no clipping")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="0 to 2**32 - 1")
    kernels: Literal["liger", "none"] = Field(
        "none",
        description="liger: Liger-Kernel's fused RMSNorm, RoPE and SwiGLU/GeGLU in the decoder layers (CUDA, "
        "pip install 'ferry[kernels]'; elsewhere a warning and the plain path); none: the plain path",
    )
    compile: bool = Field(
        False,
        description="torch.compile the repeated block (a decoder layer) once for all layers; with model offload "
        "needs offload.granularity: block, and is refused on CUDA (NaN losses on an H100, issue 53); the compiled "
        "code is cached for later jobs of the same shape",
    )
    profile: bool = Field(
        False,
        description="run torch.profiler over two steps after the first two and report the share of step time "
        "in matmuls, attention, copies waited on, the optimizer and the rest, and the MFU (a job event)",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="bf16/fp16: compute in it, trainable weights kept in float32; no: the model's dtype"
    )
    gradient_checkpointing: bool = False
    objective: Literal["sft", "dpo", "orpo", "grpo"] = Field(
        "sft",
        description="sft: next-token loss on the labels; dpo/orpo: preference pairs (data.format: preference); "
        "grpo: rewards of sampled completions (data.format: prompt)",
    )
    dpo: DPOSpec = DPOSpec()
    orpo: ORPOSpec = ORPOSpec()
    grpo: GRPOSpec = GRPOSpec()
    # The families' own fields follow (ModelFamily.training_fields), added below.

    @model_validator(mode="before")
    @classmethod
    def _read_auto(cls, data: Any) -> Any:
        """``batch_size: auto`` / ``epochs: auto``: a placeholder of 1, the field listed in ``auto`` until the data
        is read (the fields stay ints for every rule and consumer; nothing trains on the placeholder)."""
        if not isinstance(data, dict):
            return data
        given = [name for name in ("batch_size", "epochs") if data.get(name) == "auto"]
        if not given:
            return data
        listed = data.get("auto") or []
        return {**data, **dict.fromkeys(given, 1), "auto": [*listed, *(n for n in given if n not in listed)]}

    @model_validator(mode="after")
    def _check_steps_or_epochs(self) -> TrainingSpec:
        # Neither is refused by rules.py for training jobs only: a task: cache job needs no length.
        if self.steps is not None and self.epochs is not None:
            raise broken_rules([("steps", "give exactly one of training.steps and training.epochs")])
        return self


class OffloadSpec(Section):
    """The seed's three flags plus the engine's options (see offload.OffloadOptions)."""

    enable_model_cpu_offload: bool = False
    enable_optimizer_cpu_offload: bool = False
    cpu_offload_split_threshold: float | None = Field(None, gt=0, description="MB; split modules above this")
    prefetch: int = Field(1, ge=0, le=1024, description="units copied ahead; 0 = the seed's serialized behaviour")
    granularity: Literal["leaf", "block"] = "leaf"
    gpu_memory_budget: int | str | None = Field(
        AUTO_BUDGET,
        description="bytes or e.g. '8GiB' of weights kept on the device; 'auto' (the default) = what "
        "gpu_memory_limit (or the GPU) leaves above the estimated streamed peak, less a margin, refined on a GPU "
        "from the peak of the first two steps; on the CPU without gpu_memory_limit every unit streams; "
        "null = stream every unit",
    )
    gpu_memory_limit: int | str | None = Field(
        None, description="bytes or e.g. '24GiB': the job's process may use no more device memory; null = the GPU"
    )
    host_memory_limit: int | str | None = Field(
        None,
        description="bytes or e.g. '16GiB': the offload engine's pinned host memory (weights kept in RAM, buffers, "
        "trainable masters and gradients, the disk tier's staging ring); frozen weights beyond it are read from "
        "the checkpoint's safetensors files on each use; null = every weight in RAM (or the server's "
        "host_memory_budget shared between its workers)",
    )
    disk_read_ahead: int = Field(2, ge=0, le=64, description="units the disk tier reads ahead of the one copied")
    disk_io: Literal["auto", "direct", "buffered"] = Field(
        "auto",
        description="how the disk tier reads the checkpoint and the optimizer state's swap files are read and "
        "written: direct = O_DIRECT, past the page cache (whose copies count against host memory and push out other "
        "jobs' pages), failing the job at start where the filesystem refuses it; buffered = through the page cache; "
        "auto = direct where the filesystem allows",
    )
    delayed_update: bool = Field(
        False, description="step t's CPU optimizer update runs during step t+1 (gradients one step stale)"
    )
    delayed_update_warmup_steps: int = Field(10, ge=0, description="exact optimizer steps before delayed_update")
    dequantize_on_arrival: bool = Field(
        True,
        description="model.quantize: nf4: dequantize each streamed weight once per visit on the copy stream (false: "
        "torchao dequantizes inside every call, and the rooms beside the ring slots are not allocated)",
    )
    reuse_ring_slots: bool = Field(
        True,
        description="a frozen weight whose ring slot still holds it from its last visit is not copied again "
        "(false: copy on every visit)",
    )
    # auto by default: a long sequence that fits only with its block inputs on the host runs on the first try instead
    # of being refused (a job that fits keeps them on the device and streams nothing more).
    activations: bool | Literal["auto"] = Field(
        "auto",
        description="keep what gradient checkpointing saves (each block's input) in pinned host memory until "
        "its recompute, so the sequence length is bound by host memory; auto (the default): when the estimate "
        "says they would not fit in offload.gpu_memory_limit (or the GPU); false: never",
    )

    @field_validator("gpu_memory_budget", "gpu_memory_limit", "host_memory_limit")
    @classmethod
    def _check_size(cls, value: int | str | None, info: ValidationInfo) -> int | str | None:
        if value == AUTO_BUDGET and info.field_name == "gpu_memory_budget":
            return value
        try:
            size = parse_bytes(value, name=f"offload.{info.field_name}")
        except ValueError:
            size = 0
        if value is not None and not size:
            also = " or 'auto' (measured after two steps)" if info.field_name == "gpu_memory_budget" else ""
            raise ValueError(f"must be a positive size, e.g. '8GiB'{also}; got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_budget_below_limit(self) -> OffloadSpec:
        if self.gpu_memory_budget == AUTO_BUDGET:  # measured below the limit by construction
            return self
        budget, limit = parse_bytes(self.gpu_memory_budget), parse_bytes(self.gpu_memory_limit)
        if budget and limit and budget >= limit:
            raise broken_rules(
                [
                    (
                        "gpu_memory_budget",
                        f"must be below offload.gpu_memory_limit ({self.gpu_memory_limit}): the resident "
                        f"weights count against the limit; got {self.gpu_memory_budget}",
                    )
                ]
            )
        return self

    def engine_options(self, **overrides: Any) -> OffloadOptions:
        """The engine options this section sets (every ``OffloadOptions`` field it has), then ``overrides``:
        one mapping for the training job, the cache job's encoders and the estimate, so a new option reaches
        all three."""
        names = {f.name for f in dataclasses.fields(OffloadOptions)}
        return OffloadOptions(**{**{n: getattr(self, n) for n in names if n in type(self).model_fields}, **overrides})

    @model_validator(mode="after")
    def _check_activations_need_model_offload(self) -> OffloadSpec:
        if self.activations is True and not self.enable_model_cpu_offload:
            raise broken_rules(
                [("activations", "needs offload.enable_model_cpu_offload: true (the engine moves them)")]
            )
        return self

    @model_validator(mode="after")
    def _check_host_limit_needs_model_offload(self) -> OffloadSpec:
        if self.host_memory_limit is not None and not self.enable_model_cpu_offload:
            raise broken_rules(
                [
                    (
                        "host_memory_limit",
                        "needs offload.enable_model_cpu_offload: true (it bounds the engine's host copies)",
                    )
                ]
            )
        return self

    @model_validator(mode="after")
    def _check_delayed_update_needs_optimizer_offload(self) -> OffloadSpec:
        if self.delayed_update and not self.enable_optimizer_cpu_offload:
            raise broken_rules(
                [("delayed_update", "needs offload.enable_optimizer_cpu_offload: true (it delays the CPU optimizer)")]
            )
        return self

    @model_validator(mode="after")
    def _check_optimizer_offload_needs_model_offload(self) -> OffloadSpec:
        if self.enable_optimizer_cpu_offload and not self.enable_model_cpu_offload:
            raise broken_rules(
                [
                    (
                        "enable_optimizer_cpu_offload",
                        "needs offload.enable_model_cpu_offload: true (the seed's flags combine that way)",
                    )
                ]
            )
        return self


class CheckpointSpec(Section):
    """When to save and how many to keep."""

    every_steps: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="save every N optimizer steps; null = only at the end"
    )
    keep_last: int = Field(3, gt=0, le=1_000_000, description="delete older checkpoints beyond this many")
    save_final: bool = True


class GgufExportSpec(Section):
    """The final checkpoint written as one GGUF file (llama.cpp, Ollama, LM Studio) with an Ollama Modelfile."""

    quant: str = Field(
        "f16", description="f32, f16, bf16, q8_0 or q4_k_m (other K-quants: llama-quantize the f16 file)"
    )

    @field_validator("quant")
    @classmethod
    def _check_quant(cls, value: str) -> str:
        from jobs.checkpoints.gguf_quants import check_quant  # torch-free

        return check_quant(value)


class ExportSpec(Section):
    """Exports written when the job succeeds, from its best checkpoint (lowest eval loss) or else its last."""

    gguf: GgufExportSpec | None = Field(None, description="e.g. {quant: q8_0}; null: no GGUF file")
    merged: bool = Field(False, description="a LoRA adapter merged into its base model (save_pretrained + .tar)")

    def formats(self) -> list[str]:
        """The formats asked for, in the order they are written."""
        return [name for name, wanted in (("merged", self.merged), ("gguf", self.gguf is not None)) if wanted]


# ---- the job -----------------------------------------------------------------------------------------
class JobSpec(Section):
    """A whole training job. Build it with `jobs.load_job_spec`, which reports every problem at once."""

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="letters, digits, '.', '_', '-'; names the default output directory",
    )
    model: ModelSpec
    data: DataSpec
    lora: LoraSpec | None = None
    training: TrainingSpec = Field(TrainingSpec(), description="required for task: train (steps or epochs)")
    offload: OffloadSpec = OffloadSpec()
    distributed: DistributedSpec = DistributedSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    export: ExportSpec = Field(ExportSpec(), description="files other programs load, written when the job succeeds")

    eval: EvalSpec | None = None
    text_samples: TextSamplesSpec | None = Field(None, description="text from fixed prompts (language models)")
    tracking: TrackingSpec = TrackingSpec()
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto: CUDA when present, else the CPU")
    task: str = Field("train", description="train, or a task of the model's family")
    # The families' own sections follow (ModelFamily.job_sections), added below.


# ---- what the families add ---------------------------------------------------------------------------
# The type checker sees the shared sections above; the classes built from them here are the ones that
# validate (and pickle: they keep the names). A field a family adds lands after the shared ones, in
# registry order, so the valid keys an error lists read as before.
if not TYPE_CHECKING:
    TrainingSpec = create_model(
        "TrainingSpec",
        __base__=TrainingSpec,
        __module__=__name__,
        __doc__=TrainingSpec.__doc__,
        **registry.training_fields(),
    )
    _task, _task_help = registry.task_annotation()
    JobSpec = create_model(
        "JobSpec",
        __base__=JobSpec,
        __module__=__name__,
        __doc__=JobSpec.__doc__,
        training=(TrainingSpec, Field(TrainingSpec(), description="required for task: train (steps or epochs)")),
        task=(_task, Field("train", description=_task_help)),
        **registry.job_sections(),
    )
