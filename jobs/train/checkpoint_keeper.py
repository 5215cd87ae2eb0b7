"""The training loop's checkpoints: when one is due, saving at most once a step, and the events that say so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs.checkpoints.directory import CheckpointInfo, save_checkpoint
from jobs.checkpoints.export import save_tokenizer
from jobs.checkpoints.sample_artifacts import keep_samples
from jobs.checkpoints.training_state import save_training_state
from jobs.distributed.group import leads
from jobs.events import CheckpointEvent, FileDigest, Report
from jobs.spec.job import JobSpec
from jobs.train.between_steps import EvalAndSamples
from jobs.train.session import TrainingSession


def checkpoint_due(session: TrainingSession, spec: JobSpec, step: int) -> bool:
    """Whether ``checkpoint.every_steps`` or the sampler's ``every_steps`` falls on ``step``."""
    sample_every = session.sampler.every_steps if session.sampler is not None else None
    return any(n is not None and step % n == 0 for n in (spec.checkpoint.every_steps, sample_every))


class CheckpointKeeper:
    """The job's checkpoint bookkeeping: the last one saved, saving at most once per step, and its events."""

    def __init__(
        self,
        session: TrainingSession,
        spec: JobSpec,
        resolved: dict[str, Any],
        output_dir: Path,
        report: Report,
        between: EvalAndSamples,
    ) -> None:
        self.session, self.spec, self.resolved = session, spec, resolved
        self.output_dir, self.report, self.between = output_dir, report, between
        self.saved = session.resumed_from
        self.saved_step = self.saved.step if self.saved is not None else None  # the same on every rank

    @property
    def last_path(self) -> str | None:
        return self.saved.path if self.saved is not None else None

    def save(self, step: int) -> CheckpointInfo | None:
        """Checkpoint at ``step`` (rank 0 writes it; None on other ranks); the last one if nothing trained since."""
        if self.saved_step == step:
            return self.saved  # nothing trained since the last save
        self.saved_step = step
        # Every rank: the parts of an optimizer the ranks split are gathered to rank 0 (a collective).
        shards = self.session.optimizer_shards
        optimizer_state = shards.whole_state_dict() if shards is not None else None
        if not leads():
            self.saved = None
            return None  # rank 0 writes the job's checkpoints; the other ranks train on
        eval_loss = self.between.eval_loss_at(step)  # in the manifest: the best checkpoint is kept and marked
        info = _write_checkpoint(
            self.session, self.resolved, self.output_dir, step, self.spec, eval_loss, self.between.state_dict(),
            optimizer_state,
        )  # fmt: skip
        files = [FileDigest(**entry) for entry in info.files]
        self.report(CheckpointEvent(step=step, name=info.name, path=info.path, files=files))
        if self.session.sampler is not None:
            texts = getattr(self.session.sampler, "texts", None)  # an image-text sampler's answers
            for event in keep_samples(info, self.output_dir, self.session.sampler.prompts, texts):
                self.report(event)
        self.saved = info
        return info


def _write_checkpoint(
    session: TrainingSession,
    resolved: dict[str, Any],
    output_dir: Path,
    step: int,
    spec: JobSpec,
    eval_loss: float | None,
    eval_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None = None,
) -> CheckpointInfo:
    def write(directory: Path) -> None:
        if session.manager is not None:
            session.manager.wait_for_optimizer()  # background CPU updates finish before the weights are read
        session.family.weights_format.save(session.model, directory)
        if session.text is not None:
            save_tokenizer(session.text.tokenizer, directory)  # beside the weights: the checkpoint loads alone
        save_training_state(
            directory,
            step=step,
            data_position=step * spec.training.gradient_accumulation_steps,
            optimizer=session.optimizer,
            scheduler=session.scheduler,
            extra={"eval": eval_state},
            optimizer_state=optimizer_state,
        )
        if session.sampler is not None:
            session.sampler.write(session.forward_model, directory)

    return save_checkpoint(output_dir, step, resolved, write, keep_last=spec.checkpoint.keep_last, eval_loss=eval_loss)
