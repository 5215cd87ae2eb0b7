"""`run_job`: a validated spec in, a trained and checkpointed model out, progress through ``report``."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from jobs.data.auto_size import choose_auto
from jobs.distributed.group import current_group, leads
from jobs.distributed.optimizer_shards import whole_optimizer_reason
from jobs.errors import OutOfMemoryHint
from jobs.events import (
    FinishedEvent,
    GRPOMetrics,
    LogEvent,
    PreferenceMetrics,
    Report,
    StartedEvent,
    StepEvent,
    StopPoll,
    failed_event,
)
from jobs.models import LossFn, family_of
from jobs.reporting.step_profile import StepProfiler, peak_flops, training_flops
from jobs.reporting.telemetry import StepClock, device_identity, step_event
from jobs.reporting.tracking import Tracking
from jobs.spec.job import JobSpec
from jobs.train.between_steps import EvalAndSamples
from jobs.train.checkpoint_keeper import CheckpointKeeper, checkpoint_due
from jobs.train.final_exports import write_final_exports
from jobs.train.gc_pauses import setup_frozen_for_the_collector
from jobs.train.oom import oom_message
from jobs.train.reference_logps import needs_reference_pass, prepare_reference_logps
from jobs.train.session import TrainingSession, close_session, open_session, resolve_device
from offload import OffloadTrainingManager, parse_bytes, return_cached_host_memory, set_gpu_memory_limit

if TYPE_CHECKING:
    from jobs.objectives.grpo import Rollout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobOutcome:
    """How a run ended: ``succeeded``, ``paused`` (resumable from ``checkpoint``) or ``cancelled``."""

    status: Literal["succeeded", "paused", "cancelled"]
    step: int
    checkpoint: str | None


def train_step(
    model: nn.Module,
    loss_fn: LossFn,
    batches: list[dict[str, torch.Tensor]],
    *,
    optimizer: Any,
    scheduler: Any,
    accelerator: Any,
    manager: OffloadTrainingManager | None,
    max_grad_norm: float | None,
    device: torch.device,
) -> torch.Tensor:
    """One optimizer step over ``batches`` (gradient accumulation); returns the mean loss, still on the device.

    No I/O, no logging: tests call it directly.
    """
    total = torch.zeros((), device=device)
    for batch in batches:
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        with accelerator.autocast():
            loss = loss_fn(model, batch) / len(batches)
        accelerator.backward(loss)
        if manager is not None:
            manager.after_backward()  # between backward and the optimizer: host gradients land, marks reset
        total += loss.detach()
    if max_grad_norm is not None:
        accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def run_job(
    spec: JobSpec,
    *,
    output_dir: Path | str,
    report: Report | None = None,
    resume: bool = True,
    should_stop: StopPoll | None = None,
    cache_dir: Path | str | None = None,
) -> JobOutcome:
    """Train ``spec`` to the end, a pause or a cancel, checkpointing into ``output_dir/checkpoints``.

    Args:
        spec: A spec from `load_job_spec`.
        output_dir: Where checkpoints go; an existing checkpoint there is resumed from when ``resume``.
        report: Receives the typed events of jobs/events.py (started, step, checkpoint, ...).
        resume: Continue from the newest valid checkpoint in ``output_dir``.
        should_stop: Polled before every step; ``"pause"`` checkpoints and returns, ``"cancel"`` returns.
        cache_dir: Where what later jobs with the same inputs reuse is kept (DPO's reference log-probs): the
            service's one directory for all its jobs; None: ``output_dir/cache``, this job's own.

    Returns:
        The outcome. Errors propagate after a ``failed`` event; a CUDA out-of-memory error is re-raised
        as `OutOfMemoryHint` naming the setting that would help.

    Example:
        >>> spec = load_job_spec(Path("configs/cpu_smoke.yaml").read_text())
        >>> run_job(spec, output_dir=Path("out/smoke"), report=print).status
        'succeeded'
    """
    output_dir, report = Path(output_dir), report or (lambda event: None)
    output_dir.mkdir(parents=True, exist_ok=True)
    spec, chosen = choose_auto(spec)  # batch_size/epochs: auto, from the data (as the checker chose at submit)
    if spec.distributed.world_size > 1 and current_group() is None:  # the launcher; each rank runs this again
        from jobs.distributed.launch import run_ranks

        return run_ranks(
            spec,
            run_job,
            output_dir=output_dir,
            report=report,
            resume=resume,
            should_stop=should_stop,
            cache_dir=cache_dir,
        )
    resolved = spec.model_dump(mode="json")
    log.info("job %s: resolved spec %s", spec.name, json.dumps(resolved))
    session: TrainingSession | None = None
    tracking: Tracking | None = None
    step = 0
    try:
        _warn_skipped_settings(spec, report)
        for why in chosen:
            report(LogEvent(level="info", message=why))
        if spec.task != "train":
            outcome = _run_task(spec, report, should_stop)
            report(FinishedEvent(status=outcome.status, step=outcome.step))
            return outcome
        if leads():  # one rank of a data-parallel job writes the job's files
            tracking = report = Tracking(spec, output_dir, report)  # TensorBoard (MLflow, W&B) see every event too
        session = open_session(spec, output_dir, resume=resume, cache_dir=Path(cache_dir) if cache_dir else None)
        step = session.start_step
        report(
            StartedEvent(
                total_steps=session.total_steps,
                spec=resolved,
                resumed_from_step=session.start_step if session.resumed_from else None,
                device=device_identity(session.device),
                load=session.load,
            )
        )
        for level, message in session.notices:  # training.kernels, offload.gpu_memory_budget: auto
            report(LogEvent(level=level, message=message))
        for why in session.passed_over:  # a damaged newer checkpoint: resumed from an older one
            report(LogEvent(level="warning", message=why))
        if session.text is not None:
            report(LogEvent(level="info", message=session.text.summary))  # truncated and skipped examples
        if needs_reference_pass(spec):  # dpo on a full fine-tune: the initial model's log-probs, before step 1
            prepare_reference_logps(session, spec, output_dir, report, cache_dir=cache_dir)
        with setup_frozen_for_the_collector():  # no full collection walks the model in the middle of a step
            outcome = _train(session, spec, resolved, output_dir, report, should_stop)
        if outcome.status == "succeeded" and spec.export.formats() and leads():
            close_session(session)  # the exporters load the checkpoint themselves: the training model goes first
            session = None
            return_cached_host_memory()
            write_final_exports(spec, output_dir, report)
        report(FinishedEvent(status=outcome.status, step=outcome.step))
        return outcome
    except torch.OutOfMemoryError as error:
        hint = OutOfMemoryHint(oom_message(spec, step, error))
        report(failed_event(hint))  # error code out_of_memory
        raise hint from error
    except BaseException as error:
        report(failed_event(error))
        raise
    finally:
        close_session(session)
        session = None  # the model and the engine's pinned host copies go with it
        return_cached_host_memory()  # ... and back to the system, for a next job in this process
        if tracking is not None:
            tracking.close()


def _run_task(spec: JobSpec, report: Report, should_stop: StopPoll | None) -> JobOutcome:
    """A job other than training (e.g. ``task: cache``), run by the model family; it reports its own start."""
    device = resolve_device(spec.device)
    limit = parse_bytes(spec.offload.gpu_memory_limit, name="offload.gpu_memory_limit")
    if limit is not None:
        set_gpu_memory_limit(device, limit, name="offload.gpu_memory_limit")
    try:
        status, step = family_of(spec.model).tasks[spec.task](
            spec, device=device, report=report, should_stop=should_stop
        )
    finally:
        if limit is not None:
            set_gpu_memory_limit(device, None)
    return JobOutcome(status, step, None)


def _train(
    session: TrainingSession,
    spec: JobSpec,
    resolved: dict[str, Any],
    output_dir: Path,
    report: Report,
    should_stop: StopPoll | None,
) -> JobOutcome:
    """The training loop: steps until ``total``, a pause, a cancel or an early stop, checkpointing when due."""
    step, total = session.start_step, session.total_steps
    clock = StepClock(step, total)
    between = EvalAndSamples(session, spec, report, session.resumed_extra.get("eval"), output_dir)
    checkpoints = CheckpointKeeper(session, spec, resolved, output_dir, report, between)
    if step == 0:  # a resumed job evaluated the base model in its first attempt
        between.before_first_step()
    profiler = _step_profiler(session, spec) if spec.training.profile else None
    while step < total:
        request = should_stop() if should_stop is not None else None
        if request == "pause":
            paused_at = checkpoints.save(step)
            return JobOutcome("paused", step, paused_at.path if paused_at else None)
        if request == "cancel":
            return JobOutcome("cancelled", step, checkpoints.last_path)
        if profiler is not None:
            profiler.before_step(step + 1)
        event, rollout = _run_step(session, spec, step, clock)
        report(event)
        for message in _new_grader_errors(session):  # a grader's distinct failures, each once, in the events
            report(LogEvent(level="warning", message=message))
        step += 1
        if rollout is not None:
            between.grpo_samples(step, rollout)
        if session.compiled is not None and step == session.start_step + 1:  # the first step compiled the blocks
            report(LogEvent(level="info", message=session.compiled.summary()))
        profiled = profiler.after_step(step, _step_tokens(session, spec)) if profiler is not None else None
        if profiled is not None:
            report(LogEvent(level="info", message=profiled.message()))
        stop_early = between.after_step(step)
        group = current_group()
        if group is not None:
            stop_early = group.agree(stop_early)  # rank 0's decision: every rank leaves after the same step
        if checkpoint_due(session, spec, step) and step < total:
            checkpoints.save(step)
        if stop_early:
            break
    between.at_end(step)
    if spec.checkpoint.save_final:
        checkpoints.save(step)
    return JobOutcome("succeeded", step, checkpoints.last_path)


def _step_profiler(session: TrainingSession, spec: JobSpec) -> StepProfiler:
    """``training.profile``: torch.profiler over two steps after the first two (jobs/reporting/step_profile.py)."""
    model, manager = session.model, session.manager
    seq_len = session.data.tokens_per_sample or 0
    frozen = next((p for p in model.parameters() if p.is_floating_point() and not p.requires_grad), None)
    precision = spec.training.mixed_precision
    dtype = torch.bfloat16 if precision != "no" else (frozen.dtype if frozen is not None else torch.float32)
    return StepProfiler.over_steps(
        session.start_step,
        session.total_steps,
        device=session.device,
        flops=lambda tokens: training_flops(model, tokens, seq_len),
        peak=peak_flops(session.device, dtype),
        copy_wait=(lambda: manager.stats().copy_wait_seconds) if manager is not None else None,
    )


def _step_tokens(session: TrainingSession, spec: JobSpec) -> int | None:
    """The tokens of one optimizer step on this rank (its FLOPs are this device's); None for data that is not tokens."""
    per_sample = session.data.tokens_per_sample
    return spec.training.batch_size * spec.training.gradient_accumulation_steps * per_sample if per_sample else None


def _run_step(session: TrainingSession, spec: JobSpec, done: int, clock: StepClock) -> tuple[StepEvent, Rollout | None]:
    """Train the step after ``done`` steps; returns its event (loss, rate, timing, memory, preference or grpo
    metrics) and, for grpo, what the step sampled and how it was graded."""
    training = spec.training
    accumulation = training.gradient_accumulation_steps
    lr = session.optimizer.param_groups[0]["lr"]  # the rate this step uses
    first = done * accumulation  # data position: micro-batches consumed so far
    grpo = training.objective == "grpo"
    rollout = None
    if grpo:  # sampled from the policy as it is now, graded: this step's batches
        batches, rollout = grpo_batches(session, range(first, first + accumulation))
    else:
        batches = [session.data.batch(index) for index in range(first, first + accumulation)]
    training_started = time.perf_counter()
    loss = train_step(
        session.forward_model,
        session.loss_fn,
        batches,
        optimizer=session.optimizer,
        scheduler=session.scheduler,
        accelerator=session.accelerator,
        manager=session.manager,
        max_grad_norm=training.max_grad_norm,
        device=session.device,
    )
    group = current_group()  # data parallelism: the loss and the batch are the ranks' together
    loss_value = (group.mean(loss) if group else loss).item()  # CPU-GPU sync point: once per step
    training_s = time.perf_counter() - training_started  # after the sync: the device's work is done
    step = done + 1
    samples = training.batch_size * accumulation * spec.distributed.world_size
    timing = clock.tick(step)
    tokens = samples * session.data.tokens_per_sample if session.data.tokens_per_sample else None
    event = step_event(
        step=step,
        total_steps=session.total_steps,
        loss=loss_value,
        lr=lr,
        samples=samples,
        tokens=tokens,
        timing=timing,
        device=session.device,
        offload=session.manager.stats() if session.manager else None,
    )
    if group is not None:
        event = group.with_rank_figures(event, timing["step_s"])  # every rank's time and memory
    take_metrics = getattr(session.loss_fn, "take_metrics", None)  # dpo/orpo: rewards and log-probs
    if grpo and callable(take_metrics):
        event = event.model_copy(update={"grpo": grpo_figures(take_metrics(), training_s)})
    elif callable(take_metrics):
        event = event.model_copy(update={"preference": PreferenceMetrics(**take_metrics())})
    return event, rollout


def grpo_figures(metrics: dict[str, float], training_s: float) -> GRPOMetrics:
    """A grpo step's event figures from its loss's metrics: generation and training throughput apart (the
    decode loop's completion tokens over its seconds; the tokens the loss read over the training pass's)."""
    generated, generation_s = metrics.pop("generated_tokens", None), metrics.pop("generation_s", None)
    trained = metrics.pop("training_tokens", None)
    kept = metrics.pop("generation_units_kept", None)
    return GRPOMetrics(
        **metrics,
        generation_units_kept=None if kept is None else int(kept),
        generated_tokens=None if generated is None else int(generated),
        generation_s=generation_s,
        generation_tokens_per_s=generated / generation_s if generated is not None and generation_s else None,
        training_s=training_s,
        training_tokens_per_s=trained / training_s if trained is not None and training_s > 0 else None,
    )


def _new_grader_errors(session: TrainingSession) -> list[str]:
    """grpo: the grader errors first seen in the last step (jobs/objectives/graders/rewards.py); else none."""
    take = getattr(getattr(session.loss_fn, "grade", None), "take_new_errors", None)
    return list(take()) if callable(take) else []


def grpo_batches(session: TrainingSession, indices: range) -> tuple[list[dict[str, torch.Tensor]], Rollout]:
    """A grpo step's micro-batches: the prompts at ``indices``, G completions each, sampled together and graded;
    and the rollout they came from."""
    from jobs.objectives.grpo import GRPOLoss

    loss_fn, data = session.loss_fn, session.data
    assert isinstance(loss_fn, GRPOLoss)
    prompts = getattr(data, "prompts")  # noqa: B009 (PromptData; BatchSource has no prompts)
    micro_batches = [prompts(i) for i in indices]
    return loss_fn.step_batches(
        session.forward_model, micro_batches, device=session.device, autocast=session.accelerator.autocast
    )


def _warn_skipped_settings(spec: JobSpec, report: Report) -> None:
    """Engine options given without model offload do nothing, and several ranks keep the whole CPU optimizer
    state each where they cannot split it; say so rather than ignore them silently."""
    ignored = sorted(
        spec.offload.model_fields_set & {"prefetch", "granularity", "gpu_memory_budget", "cpu_offload_split_threshold"}
    )
    messages = []
    if ignored and not spec.offload.enable_model_cpu_offload:
        messages.append(f"offload.{', offload.'.join(ignored)} ignored: offload.enable_model_cpu_offload is false")
    whole = whole_optimizer_reason(spec)
    if whole is not None:
        messages.append(f"each of the {spec.distributed.world_size} ranks keeps the whole CPU optimizer state: {whole}")
    for message in messages:
        log.warning(message)
        report(LogEvent(level="warning", message=message))
