"""Setting up a training run: model, adapters, placement (offloaded or not), data, optimizer, resume."""

from __future__ import annotations

import gc
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from accelerate import Accelerator
from torch import nn

from jobs.checkpoints.directory import CheckpointInfo, remove_interrupted_saves, resume_point
from jobs.checkpoints.training_state import load_training_state, restore_rng
from jobs.data import BatchSource, TextData, build_data, model_keeps_documents_apart, prepare_text_data
from jobs.distributed.group import current_group, leads
from jobs.distributed.optimizer_shards import OptimizerShards, splits_optimizer
from jobs.events import LoadStats
from jobs.fit.checks import compile_problem
from jobs.fit.optimizer_swap import SWAP_FOLDER, SwapDecision, decide_optimizer_swap
from jobs.models import LossFn, ModelFamily, build_model, enable_gradient_checkpointing, family_of
from jobs.models.compiled_blocks import CompiledBlocks, compile_repeated_blocks, use_inductor_cache
from jobs.models.fused_kernels import Notice, fused_kernels_notice
from jobs.models.loading.weight_sources import LoadReport, WeightSource
from jobs.recompute import apply_activation_checkpointing, offload_checkpointed_inputs
from jobs.recompute.chunked_loss import keep_logits_whole
from jobs.reporting.telemetry import peak_rss_bytes
from jobs.spec.job import JobSpec
from jobs.train.optim import build_optimizer, build_scheduler
from offload import OffloadTrainingManager, OptimizerShard, parse_bytes, set_gpu_memory_limit
from offload.options import AUTO_BUDGET

if TYPE_CHECKING:
    from jobs.fit.budget import BudgetDecision
    from jobs.fit.loss_logits import LossLogitsDecision

log = logging.getLogger(__name__)


class Sampler(Protocol):
    """What a family's ``make_sampler`` returns: samples written into each checkpoint, on a schedule."""

    every_steps: int  # generate (and checkpoint) every N optimizer steps, and at the end
    prompts: list[str]  # the fixed prompts, in the order of the samples' files

    def write(self, model: nn.Module, directory: Path) -> list[str]: ...
    def close(self) -> None: ...


@dataclass(kw_only=True)
class TrainingSession:
    """Everything a training loop needs, built by `open_session` and torn down by `close_session`."""

    accelerator: Accelerator
    device: torch.device
    model: nn.Module  # the model as built (CPU-resident when offloaded); what checkpoints save
    forward_model: nn.Module  # what the step calls: ``model``, or accelerate's prepared version of it
    loss_fn: LossFn
    data: BatchSource
    optimizer: Any  # accelerate's AcceleratedOptimizer
    scheduler: Any  # accelerate's AcceleratedScheduler
    manager: OffloadTrainingManager | None
    total_steps: int
    start_step: int
    resumed_from: CheckpointInfo | None
    family: ModelFamily[Any]  # the model's registry entry: how its weights are checkpointed
    sampler: Sampler | None = None  # writes samples into each checkpoint (family.make_sampler), or None
    text: TextData | None = None  # text jobs: the tokenizer and the eval set
    resumed_extra: dict[str, Any] = field(default_factory=dict)  # the runner's state from the checkpoint
    load: LoadStats | None = None  # how the weights were loaded (reported in the started event)
    passed_over: list[str] = field(default_factory=list)  # why newer checkpoints were not resumed from
    # (level, message) for the job's events: which fused kernels ran, what gpu_memory_budget auto chose and why
    notices: list[Notice] = field(default_factory=list)
    optimizer_shards: OptimizerShards | None = None  # data parallelism: this rank's part of the CPU optimizer
    compiled: CompiledBlocks | None = None  # training.compile: the blocks that run compiled


def resolve_device(choice: str) -> torch.device:
    """``auto`` picks CUDA when present; ``cuda`` without a GPU is an error naming the fix."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda, but no CUDA device is available here; use device: auto or cpu")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def total_steps(spec: JobSpec, data: BatchSource) -> int:
    """Optimizer steps for the job: ``training.steps``, or the epochs' worth of micro-batches."""
    if spec.training.steps is not None:
        return spec.training.steps
    epochs, per_epoch = spec.training.epochs, data.batches_per_epoch
    if epochs is None or per_epoch is None:  # refused at submit time (rules.py); say so if called directly
        raise ValueError("training.epochs needs a finite dataset; use training.steps instead")
    return max(1, epochs * per_epoch // spec.training.gradient_accumulation_steps)


def open_session(spec: JobSpec, output_dir: Path, *, resume: bool, cache_dir: Path | None = None) -> TrainingSession:
    """Build the run, following the seed's integration, one named step after another.

    With model offload the model stays on the CPU: it is never ``.to(device)``-ed nor passed to
    ``accelerator.prepare``; the engine attaches to it instead. Accelerate handles the rest (device,
    mixed precision, loss scaling, optimizer and scheduler wrapping). The order of the steps is the order of
    the random draws, so a resumed job and a fresh one see the same numbers. ``cache_dir``: what later jobs
    reuse (``training.compile``'s compiled blocks); None: ``output_dir/cache``.
    """
    accelerator, limit = _setup_device(spec)
    device = accelerator.device
    family = family_of(spec.model)
    loading_started = time.perf_counter()
    model, loss_fn, source, notices = _setup_model(spec, family, device)
    loss_logits = _decided_loss_logits(spec)
    if loss_logits is not None:
        keep_logits_whole(model, loss_logits.whole)
        notices.append(("info", loss_logits.message))
    compiled = _setup_compile(spec, model, cache_dir or output_dir / "cache", device)
    if spec.training.compile and compiled is None:
        notices.append(("warning", f"training.compile: {type(model).__name__} has no repeated blocks; it runs eagerly"))
    if spec.training.objective == "grpo":
        pass  # its loss needs the tokenizer: built with its prompts below
    elif spec.training.objective != "sft":
        from jobs.objectives.preference import PreferenceLoss

        loss_fn = PreferenceLoss(spec.training, model)  # dpo's reference: the base, adapters masked per row
    if leads():  # the one process that saves: a save an earlier attempt left half-written goes first
        for name in remove_interrupted_saves(output_dir):
            log.warning("removed %s: a checkpoint save that an earlier attempt did not finish", name)
    checkpoint, passed_over = resume_point(output_dir) if resume else (None, [])
    if checkpoint is not None and source is None:
        family.weights_format.load(model, Path(checkpoint.path))  # before the engine takes the weights over
    group = current_group()  # data parallelism: each rank reads its rows of the global batch
    if spec.training.objective == "grpo":
        data, text, loss_fn = _setup_grpo(spec, model)
        if getattr(data, "skipped_long", 0):  # prompts longer than the context: said in the job's events
            notices.append(("warning", f"grpo: {getattr(data, 'summary', '')}"))
    else:
        data, text = _setup_data(group.union_spec(spec) if group else spec, family, device, model)
        notices += [("warning", note) for note in getattr(data, "notices", ())]  # e.g. images resized to fit
        data = group.shard(data) if group else data
    sampler = family.make_sampler(spec, device) if family.make_sampler is not None else None
    _check_vocab_fits(model, text.tokenizer.vocab_size if text else None)
    model.train()
    budget = _decided_budget(spec) if spec.offload.enable_model_cpu_offload else None
    manager = _setup_offload(spec, model, device, limit, source, budget)
    if manager is not None and spec.training.objective == "grpo":
        from jobs.objectives.grpo import GRPOLoss

        assert isinstance(loss_fn, GRPOLoss)  # _setup_grpo's
        loss_fn.hold_weights = manager.hold_for_inference  # the decode loop keeps what fits of the weights
    if manager is not None and spec.offload.host_memory_limit is not None:
        notices.append(("info", disk_tier_notice(spec, manager)))
        if manager.disk_stage is not None and manager.disk_stage.fallback:
            notices.append(
                ("info", f"offload.disk_io auto: {manager.disk_stage.fallback}; reading through the page cache")
            )
    swap = _decided_optimizer_swap(spec, manager)
    if swap is not None:
        notices.append(("warning" if swap.blocked else "info", swap.message))
    if checkpoint is not None and source is not None:
        # Into the engine's host masters and device adapters, now that the meta tensors are real.
        family.weights_format.load(model, Path(checkpoint.path))
    forward_model = model if manager is not None else accelerator.prepare(model)  # to the device, mixed precision
    if group is not None:  # now that the trainable weights are where their gradients will be
        group.reduce_gradients(model, manager, accumulation_steps=spec.training.gradient_accumulation_steps)

    load = _load_stats(model, source, loading_started)
    steps = total_steps(spec, data)
    raw_optimizer, optimizer, scheduler = _setup_optimizer(spec, model, accelerator, steps)
    # Data parallelism with optimizer offload: each rank steps its part of every weight (ZeRO-1).
    split = manager is not None and manager.optimizer_shard is not None
    shards = OptimizerShards(manager, raw_optimizer) if manager is not None and split else None
    # With the state swapped to disk the checkpoint's is mapped, not read: it goes to the swap files from there.
    swapped = swap is not None and swap.swap
    start_step, extra = _resume(checkpoint, raw_optimizer, scheduler, shards, mmap=swapped)
    if manager is not None:
        _setup_optimizer_offload(spec, manager, raw_optimizer, output_dir / SWAP_FOLDER if swapped else None)
        if manager.optimizer_swap is not None and manager.optimizer_swap.fallback:
            why = manager.optimizer_swap.fallback
            notices.append(
                ("info", f"offload.disk_io auto: {why}; the optimizer's swap files go through the page cache")
            )
    return TrainingSession(
        accelerator=accelerator,
        device=device,
        model=model,
        forward_model=forward_model,
        loss_fn=loss_fn,
        data=data,
        optimizer=optimizer,
        scheduler=scheduler,
        manager=manager,
        total_steps=steps,
        start_step=start_step,
        resumed_from=checkpoint,
        family=family,
        sampler=sampler,
        text=text,
        resumed_extra=extra,
        load=load,
        passed_over=passed_over,
        notices=notices + ([("info", budget.message)] if budget is not None else []),
        optimizer_shards=shards,
        compiled=compiled,
    )


def _setup_device(spec: JobSpec) -> tuple[Accelerator, int | None]:
    """The accelerator on the spec's device, the device memory limit applied, the seeds set."""
    training = spec.training
    device = resolve_device(spec.device)
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=training.mixed_precision)
    # Before anything is allocated on the device, with or without offload: the job behaves as on a card of
    # this size (the engine re-applies the same limit, so a manager used alone enforces it too).
    limit = parse_bytes(spec.offload.gpu_memory_limit, name="offload.gpu_memory_limit")
    if limit is not None:
        set_gpu_memory_limit(accelerator.device, limit, name="offload.gpu_memory_limit")
    torch.manual_seed(training.seed)
    random.seed(training.seed)
    return accelerator, limit


def _setup_model(
    spec: JobSpec, family: ModelFamily[Any], device: torch.device
) -> tuple[nn.Module, LossFn, WeightSource | None, list[Notice]]:
    """The model with its adapters, precision and quantization, its loss, the source that fills the
    engine's pinned copies when it was built on the meta device (None: built in memory), and what the job
    should say about it (``training.kernels``)."""
    training = spec.training
    source = None
    spec = _with_mlp_tiling_decided(spec)
    if _loads_into_pinned_memory(spec, family):
        # Built on the meta device: the engine's pinned arena is filled from the source directly, and
        # nothing of the frozen weights is ever materialized in ordinary memory.
        assert family.build_on_meta is not None
        model, source = family.build_on_meta(spec.model, training.seed, device)
        loss_fn = family.loss
    else:
        model, loss_fn = build_model(spec.model, training.seed)
    # Before checkpointing, adapters and the engine wrap the layers: the kernels replace the plain modules.
    kernels = fused_kernels_notice(training.kernels, family.kind, family.apply_kernels, model, device)
    if training.gradient_checkpointing:
        enable_gradient_checkpointing(model, spec.model)  # the model's own switch, then Ferry's policy on it
        apply_activation_checkpointing(model, uncheckpointed_layers=getattr(spec.model, "uncheckpointed_layers", 0))
    if spec.lora is not None:
        from jobs.models.lora import adapters_stay_on_the_cpu, apply_lora  # peft is slow to import: LoRA jobs only

        with adapters_stay_on_the_cpu(model):  # changes nothing unless the base is on the meta device
            if family.apply_lora is not None:
                model = family.apply_lora(model, spec.lora)
            else:
                model = apply_lora(model, spec.lora, task_type=family.peft_task_type)
    if training.mixed_precision != "no":
        keep_trainable_in_float32(model)  # before a checkpoint's float32 weights load into it
    if spec.lora is not None:
        from jobs.models.lora import no_upcast_under_autocast

        no_upcast_under_autocast(model)
    quantize = getattr(spec.model, "quantize", None)
    if quantize is not None and source is not None:
        from jobs.models.loading.quantizing_source import QuantizingSource  # torchao is an optional extra

        # The meta model's frozen linears become quantized placeholders, each quantized as it loads.
        source = QuantizingSource(source, model, quantize, device)
    elif quantize is not None:
        _quantize_base(model, quantize, device)
    return model, loss_fn, source, [kernels] if kernels is not None else []


def _setup_compile(spec: JobSpec, model: nn.Module, cache_dir: Path, device: torch.device) -> CompiledBlocks | None:
    """``training.compile``: the model's repeated blocks compiled once for all its layers (after the kernels and the
    adapters: what a block holds when it first runs is what is traced), their code kept in the cache's inductor
    folder for later jobs of the same shape."""
    if not spec.training.compile:
        return None
    problem = compile_problem(spec, has_gpu=device.type == "cuda")  # the submit check's, for jobs started without it
    if problem is not None:
        raise ValueError(problem[1])
    return compile_repeated_blocks(model, cache_dir=use_inductor_cache(cache_dir / "inductor"))


def _setup_grpo(spec: JobSpec, model: nn.Module) -> tuple[BatchSource, None, LossFn]:
    """grpo's prompts (no token batches: each step samples its own) and its loss, with the graders."""
    from jobs.data.tokenizers import build_tokenizer
    from jobs.evaluate.text_samples import stop_ids
    from jobs.objectives.graders import Graders
    from jobs.objectives.grpo import GRPOLoss
    from jobs.objectives.prompts import PromptData
    from jobs.spec.job import TextDataSpec

    if current_group() is not None:
        raise ValueError("distributed.world_size: grpo runs on one rank for now; set world_size: 1")
    assert isinstance(spec.data, TextDataSpec)  # a rule refuses grpo without data.format: prompt
    tokenizer = build_tokenizer(spec.data.tokenizer, spec.data.chat_template)
    data = PromptData.from_spec(spec, tokenizer)
    log.info("grpo: %s", data.summary)
    grpo = spec.training.grpo
    loss = GRPOLoss(
        grpo,
        Graders(grpo.grader),
        tokenizer.decode,
        stops=stop_ids(tokenizer, model),
        pad_id=tokenizer.pad_id,
        compile_decode=spec.training.compile,  # the decode steps too (jobs/objectives/compiled_decode.py)
    )
    return data, None, loss


def _setup_data(
    spec: JobSpec, family: ModelFamily[Any], device: torch.device, model: nn.Module
) -> tuple[BatchSource, TextData | None]:
    """The training batches (the family's own data, or the shared kinds), and the text data of text jobs."""
    if family.build_data is not None:
        return family.build_data(spec, device, model), None
    return _build_data(spec, family)


def _setup_offload(
    spec: JobSpec,
    model: nn.Module,
    device: torch.device,
    limit: int | None,
    source: WeightSource | None,
    budget: BudgetDecision | None,
) -> OffloadTrainingManager | None:
    """The offload engine attached to ``model`` under model offload; None without it. With
    ``offload.activations`` the engine also holds what checkpointing keeps, planned from the job's estimate."""
    if not spec.offload.enable_model_cpu_offload:
        return None
    saved = _offloaded_activations(spec)
    family = family_of(spec.model)
    whole = family.whole_units(model) if family.whole_units is not None else ()  # e.g. a frozen vision tower
    group = current_group()  # data parallelism: the ranks of a machine share one host copy of the frozen weights
    frozen_arena = group.frozen_arena_before_attach() if group else None  # other ranks wait for the first here
    manager = OffloadTrainingManager(
        model,
        device,
        enable_optimizer_cpu_offload=spec.offload.enable_optimizer_cpu_offload,
        cpu_offload_split_threshold=spec.offload.cpu_offload_split_threshold,
        options=spec.offload.engine_options(
            gpu_memory_budget=budget.engine_budget if budget is not None else spec.offload.gpu_memory_budget,
            gpu_memory_limit=limit,
            offload_activations=spec.offload.activations is True or bool(saved),
            activation_host_bytes=saved,
            whole_units=whole,
        ),
        initialize=source.fill if source is not None else None,
        frozen_arena=frozen_arena,
        # offload.host_memory_limit: frozen weights beyond it are read from the checkpoint's files on each use.
        disk=source.file_range if source is not None and spec.offload.host_memory_limit is not None else None,
        # The ranks split the CPU optimizer: this rank's gradient buffers and optimizer state hold its parts.
        optimizer_shard=OptimizerShard(group.rank, group.world_size) if group and splits_optimizer(spec) else None,
    )
    if group is not None:
        group.after_attach()
    if manager.activations is not None:
        offload_checkpointed_inputs(model, manager.activations)
    return manager


def disk_tier_notice(spec: JobSpec, manager: OffloadTrainingManager) -> str:
    """What ``offload.host_memory_limit`` decided, for the job's events: which frozen weights are read from disk,
    from which files, and which stay in RAM and why."""
    plan = manager.plan
    limit = spec.offload.host_memory_limit
    gib = 2**30
    if not plan.disk_bytes:
        return (
            f"offload.host_memory_limit {limit}: every frozen weight fits in RAM (pinned host memory "
            f"{plan.host_bytes / gib:.2f} GiB); nothing is read from disk"
        )
    units = [layout for layout in plan.layouts if layout.disk]
    files = sorted({r.path.name for layout in units for r in layout.disk})
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return (
        f"offload.host_memory_limit {limit}: {plan.disk_bytes / gib:.2f} GiB of frozen weights in {len(units)} of "
        f"{len(plan.layouts)} units are read from {shown} on each use, through a {plan.staging_bytes / gib:.2f} GiB "
        f"pinned staging ring; the pinned arena keeps {plan.pinned_reserved_bytes / gib:.2f} GiB in RAM (small units, "
        "units spread over the step, buffers, trainable weights, and weights whose stored bytes differ from what "
        "the engine streams: quantized, converted on load or stored in another dtype, which stay in RAM)"
    )


def _with_mlp_tiling_decided(spec: JobSpec) -> JobSpec:
    """``model.tiled_mlp: auto`` decided as the fit check decides it (jobs/fit/estimate.py)."""
    if getattr(spec.model, "tiled_mlp", None) != "auto":
        return spec
    from jobs.fit.estimate import with_mlp_tiling_decided  # builds meta models: only where there is a choice

    decided = with_mlp_tiling_decided(spec)
    log.info("model.tiled_mlp=auto: %s", "tiled" if decided.model.tiled_mlp else "whole MLPs")
    return decided


def _decided_loss_logits(spec: JobSpec) -> LossLogitsDecision | None:
    """Whether the loss makes its logits at once or chunk by chunk, as the fit check decides it
    (jobs/fit/loss_logits.py); None where the family's loss does not choose or there is no device to size them
    against (it then chunks large logits)."""
    from jobs.fit.loss_logits import decide_loss_logits  # builds meta models: only where there is a choice

    decision = decide_loss_logits(spec)
    if decision is not None:
        log.info("%s", decision.message)
    return decision


def _decided_budget(spec: JobSpec) -> BudgetDecision | None:
    """``offload.gpu_memory_budget: auto`` decided as the fit check decides it (jobs/fit/budget.py)."""
    if spec.offload.gpu_memory_budget != AUTO_BUDGET:
        return None
    from jobs.fit.budget import decide_budget  # builds meta models: only where there is a choice

    decision = decide_budget(spec)
    if decision is not None:
        log.info("%s", decision.message)
    return decision


def _offloaded_activations(spec: JobSpec) -> tuple[int, ...]:
    """The checkpointed inputs' host buffers when ``offload.activations`` is on (or ``auto`` turns it on)."""
    if spec.offload.activations is False or not spec.training.gradient_checkpointing:
        return ()
    from jobs.fit.estimate import offloaded_activations  # the fit check's decision and sizes, to the byte

    saved = offloaded_activations(spec)
    log.info("offload.activations=%s: %d checkpointed inputs to the host", spec.offload.activations, len(saved))
    return saved


def _setup_optimizer(
    spec: JobSpec, model: nn.Module, accelerator: Accelerator, steps: int
) -> tuple[torch.optim.Optimizer, Any, Any]:
    """The optimizer over the trainable weights and its schedule: the raw optimizer, and both as accelerate
    wraps them."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    raw_optimizer = build_optimizer(trainable, spec.training)
    optimizer, scheduler = accelerator.prepare(raw_optimizer, build_scheduler(raw_optimizer, spec.training, steps))
    return raw_optimizer, optimizer, scheduler


def _resume(
    checkpoint: CheckpointInfo | None,
    raw_optimizer: torch.optim.Optimizer,
    scheduler: Any,
    shards: OptimizerShards | None = None,
    *,
    mmap: bool = False,
) -> tuple[int, dict[str, Any]]:
    """The step to start from and the runner's saved state: the checkpoint's, with the optimizer, schedule and
    random state restored from it; (0, {}) for a fresh run. With ``shards`` the optimizer takes this rank's
    parts of the checkpoint's whole state."""
    if checkpoint is None:
        return 0, {}
    # A split optimizer maps the file and copies out its parts: no rank holds the whole state, even at load.
    state = load_training_state(Path(checkpoint.path), mmap=mmap or shards is not None)
    optimizer_state = shards.own_state_dict(state["optimizer"]) if shards is not None else state["optimizer"]
    # Into the raw optimizer: torch puts each state tensor on its parameter's device (the CPU under
    # optimizer offload), where accelerate's wrapper would first move everything to the accelerator.
    raw_optimizer.load_state_dict(optimizer_state)
    scheduler.scheduler.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])  # last: setup above may draw random numbers (peft's init)
    log.info("resuming from %s at step %d", checkpoint.path, state["step"])
    return state["step"], state.get("extra", {})


def _decided_optimizer_swap(spec: JobSpec, manager: OffloadTrainingManager | None) -> SwapDecision | None:
    """``offload.host_memory_limit`` on a full fine-tune: whether the CPU optimizer's state goes to swap files, as
    the fit check decides it (jobs/fit/optimizer_swap.py), over the weights this engine hosts."""
    if manager is None:
        return None
    hosted = [torch.empty(h.part.numel, dtype=h.master.dtype, device="meta") for h in manager.hosted_parts()]
    return decide_optimizer_swap(spec, manager.plan, hosted)


def _setup_optimizer_offload(
    spec: JobSpec, manager: OffloadTrainingManager, raw_optimizer: torch.optim.Optimizer, swap_folder: Path | None
) -> None:
    """Optimizer offload: each parameter's CPU update runs while the GPU's backward continues; with
    ``swap_folder`` its state lives in files there (offload.host_memory_limit on a full fine-tune)."""
    training = spec.training
    if spec.offload.enable_optimizer_cpu_offload and training.max_grad_norm is None:
        # Not with clipping: a global norm needs every gradient first. After load_state_dict, which
        # replaces the optimizer's state.
        manager.attach_optimizer(
            raw_optimizer,
            accumulation_steps=training.gradient_accumulation_steps,
            delayed_update=spec.offload.delayed_update,
            warmup_steps=spec.offload.delayed_update_warmup_steps,
            swap_folder=swap_folder,
            swap_read_ahead=spec.offload.disk_read_ahead,
        )


def _loads_into_pinned_memory(spec: JobSpec, family: ModelFamily[Any]) -> bool:
    """Build on meta and fill the pinned arena directly (jobs/fit/disk_tier.py says when)."""
    from jobs.fit.disk_tier import loads_into_pinned_memory

    return loads_into_pinned_memory(spec, family)


def _load_stats(model: nn.Module, source: WeightSource | None, started: float) -> LoadStats:
    """Bytes of weights loaded, how fast, and the process's peak resident memory so far."""
    if source is not None:
        report = source.finish()  # waits for the last reads and copies into the pinned arena
        nbytes, seconds, kind = report.bytes, report.seconds, report.source
    else:
        nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        seconds, kind = time.perf_counter() - started, "in_memory"
        report = LoadReport(kind, nbytes, seconds)
    return LoadStats(
        source=kind,
        bytes=nbytes,
        seconds=round(seconds, 3),
        gb_per_s=round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
        peak_host_rss_bytes=peak_rss_bytes(),
        quantized=report.quantized,
        stored_bytes=report.stored_bytes,
        quantize_seconds=None if report.quantize_seconds is None else round(report.quantize_seconds, 3),
    )


def _build_data(spec: JobSpec, family: ModelFamily[Any]) -> tuple[BatchSource, TextData | None]:
    training = spec.training
    if spec.data.kind != "text":
        width = family.synthetic_width(spec.model) if family.synthetic_width else None
        source, _ = build_data(spec.data, batch_size=training.batch_size, seed=training.seed, width=width)
        return source, None
    packed_path = family.keeps_packed_documents_apart and model_keeps_documents_apart()
    text = prepare_text_data(
        spec.data, batch_size=training.batch_size, seed=training.seed, packed_path=packed_path, eval_spec=spec.eval
    )
    return text.train, text


def keep_trainable_in_float32(model: nn.Module) -> None:
    """Mixed precision: float32 master copies of the trainable weights; autocast computes in bf16/fp16.

    A bf16 weight cannot hold an update smaller than 1/256 of itself, so at low learning rates pure bf16
    training loses progress. Frozen weights keep the model's dtype (they never change).
    """
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def _quantize_base(model: nn.Module, method: str, device: torch.device) -> None:
    """QLoRA: the frozen base's linear weights become torchao's quantized tensors (the engine streams them
    quantized); torchao's kernels run on the GPU when there is one (minutes for billions of weights on a CPU)."""
    from offload.quant.quantized import quantize_frozen_weights  # torchao is an optional extra

    names = quantize_frozen_weights(model, method, device=device if device.type == "cuda" else None)
    if not names:
        log.warning("model.quantize=%s: no frozen linear weight could be quantized; training unquantized", method)


def _check_vocab_fits(model: nn.Module, vocab: int | None) -> None:
    get_embeddings = getattr(model, "get_input_embeddings", None)  # Hugging Face models (peft-wrapped too)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    if embeddings is None:
        embeddings = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if vocab is not None and embeddings is not None and vocab > embeddings.num_embeddings:
        raise ValueError(
            f"the tokenizer has {vocab} tokens but the model's embedding has "
            f"{embeddings.num_embeddings}; use a matching data.tokenizer or model"
        )


def close_session(session: TrainingSession | None) -> None:
    """Detach the engine and free device memory, so the next job in this process starts clean."""
    if session is not None and session.manager is not None:
        session.manager.remove(copy=False)  # the model goes with the session: no second copy of its weights
    remove_hooks = getattr(session.loss_fn, "remove", None) if session is not None else None
    if callable(remove_hooks):
        remove_hooks()  # a preference loss's adapter hooks
    if session is not None and session.sampler is not None:
        session.sampler.close()
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps process-wide state; a later job may ask for a different mixed precision.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if torch.cuda.is_available():
        gc.collect()  # hooks and closures form reference cycles that can hold device tensors
        torch.cuda.empty_cache()
        if session is not None:
            set_gpu_memory_limit(session.device, None)  # the job's limit ends with the job
