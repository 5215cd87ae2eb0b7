"""What a training loop does between steps besides checkpointing: evaluate, sample, decide to stop early."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from jobs.checkpoints.sample_artifacts import SAMPLES_DIR
from jobs.evaluate.held_out import EvalHistory, evaluate
from jobs.evaluate.pairs import evaluate_pairs
from jobs.events import EvalEvent, LogEvent, PreferenceMetrics, Report, SampleEvent
from jobs.objectives.grpo import Rollout
from jobs.objectives.preference import PreferenceLoss
from jobs.spec.job import JobSpec

log = logging.getLogger(__name__)


class EvalAndSamples:
    """Runs ``eval`` and ``samples`` when their ``every_steps`` (or the end, or a checkpoint) comes.

    Args:
        session: The `TrainingSession` (model, loss, device, the text data with its eval set and tokenizer).
        spec: The job spec.
        report: Receives ``eval`` and ``sample`` events.
        state: What a resumed checkpoint saved from `state_dict`.
        output_dir: The job's output directory: where the text samples' images go (``samples/prompts/``).
    """

    def __init__(
        self,
        session: Any,
        spec: JobSpec,
        report: Report,
        state: dict[str, Any] | None = None,
        output_dir: Path | None = None,
    ) -> None:
        self.session, self.spec, self.report, self.output_dir = session, spec, report, output_dir
        early = spec.eval.early_stopping if spec.eval else None
        self.history = EvalHistory(early.min_delta if early else 0.0)
        if state:
            self.history.load_state_dict(state)
        # Text data holds its eval set; a family reading its own data may hold one out too (holds_out_eval).
        own = getattr(session.data, "eval", None) if session.family.holds_out_eval else None
        self.eval_source = session.text.eval if session.text is not None else own
        self.text_samples: Any = None  # the family's own text_samples answerer (make_text_samples), made once
        self.thumbnails: list[str | None] = []  # each text sample's image, relative to output_dir (or None)

    def state_dict(self) -> dict[str, Any]:
        return self.history.state_dict()

    def before_first_step(self) -> None:
        """The base model's eval loss at step 0, the figure training is compared against (``eval.at_start``).

        Called only by a job that starts at step 0; a checkpoint saved at step 0 remembers this evaluation,
        so resuming from it does not repeat it (see `eval_loss_at`).
        """
        if self.eval_source is not None and self.spec.eval is not None and self.spec.eval.at_start:
            self.eval_loss_at(0)

    def after_step(self, step: int) -> bool:
        """Evaluate and sample if due at ``step``; True when early stopping says training should end."""
        if self._due(self.spec.text_samples, step):
            self.sample(step)
        if self.eval_source is None or not self._due(self.spec.eval, step):
            return False
        self.eval_loss_at(step)
        assert self.spec.eval is not None  # _due() is false without an eval section
        early = self.spec.eval.early_stopping
        if early is not None and self.history.since_best >= early.patience:
            message = (
                f"early stopping at step {step}: eval loss has not improved by {early.min_delta} for "
                f"{early.patience} evaluation(s); best {self.history.best_loss:.4f} at step {self.history.best_step}"
            )
            log.info(message)
            self.report(LogEvent(level="info", message=message))
            return True
        return False

    def at_end(self, step: int) -> None:
        """The final evaluation and samples (unless they just ran at this step)."""
        if self.spec.text_samples is not None and not self._due(self.spec.text_samples, step):
            self.sample(step)
        if self.eval_source is not None:
            self.eval_loss_at(step)

    def eval_loss_at(self, step: int) -> float | None:
        """The eval loss at ``step``, evaluating now unless that was done (None without an eval set)."""
        if self.eval_source is None:
            return None
        if self.history.last_step == step:
            return self.history.last_loss
        session = self.session
        assert self.spec.eval is not None and self.eval_source is not None  # set up only with an eval section
        # dpo/orpo: the mean loss over the pairs and their rewards; sft: the token-weighted loss and perplexity
        run = evaluate_pairs if isinstance(session.loss_fn, PreferenceLoss) else evaluate
        result = run(
            session.forward_model,
            session.loss_fn,
            self.eval_source,
            max_batches=self.spec.eval.max_batches,
            device=session.device,
            accelerator=session.accelerator,
        )
        best = self.history.record(step, result)
        metrics = {"tokens": float(result.tokens), "batches": float(result.batches), "best": float(best)}
        if result.pairs is not None:
            metrics["pairs"] = float(result.pairs)
        preference = PreferenceMetrics(**result.preference) if result.preference is not None else None
        self.report(
            EvalEvent(
                step=step, eval_loss=result.loss, perplexity=result.perplexity, preference=preference, metrics=metrics
            )
        )
        return result.loss

    def sample(self, step: int) -> None:
        from jobs.evaluate.text_samples import generate_samples

        session = self.session
        own = session.family.make_text_samples
        if own is not None and session.text is None:  # the family's data (images): its processor answers
            if self.text_samples is None:
                self.text_samples = own(self.spec, session.device)
                self.thumbnails = self._write_thumbnails()
            samples = self.text_samples.generate(session.forward_model)
        else:
            samples = generate_samples(
                session.forward_model,
                self.spec,
                session.text.tokenizer,
                device=session.device,
                accelerator=session.accelerator,
            )
        for index, sample in enumerate(samples):  # one event per prompt, as the event contract has it
            image = self.thumbnails[index] if index < len(self.thumbnails) else None
            self.report(
                SampleEvent(
                    step=step,
                    prompt=sample["prompt"],
                    text=sample["completion"],
                    artifact_path=image,
                    media_type="image/png" if image else None,
                )
            )

    def _write_thumbnails(self) -> list[str | None]:
        """The family answerer's prompt images, written once under ``samples/prompts/`` (the prompts are fixed)."""
        write = getattr(self.text_samples, "thumbnails", None)
        if write is None or self.output_dir is None:
            return []
        folder = f"{SAMPLES_DIR}/prompts"
        return [f"{folder}/{name}" if name else None for name in write(Path(self.output_dir) / folder)]

    def grpo_samples(self, step: int, rollout: Rollout) -> None:
        """Every ``training.grpo.samples_every_steps`` steps: the first ``samples_prompts`` prompts of the step,
        each completion a sample event with its reward (the completions of one prompt share its text)."""
        grpo = self.spec.training.grpo
        if grpo.samples_every_steps is None or step % grpo.samples_every_steps != 0:
            return
        group = grpo.num_generations
        shown = min(grpo.samples_prompts * group, len(rollout.completions))
        for index in range(shown):
            self.report(
                SampleEvent(
                    step=step,
                    prompt=prompt_shown(rollout.rows[index // group].get("prompt")),
                    text=rollout.completions[index],
                    reward=float(rollout.rewards[index]),
                )
            )

    @staticmethod
    def _due(section: Any, step: int) -> bool:
        return section is not None and section.every_steps is not None and step % section.every_steps == 0


def prompt_shown(prompt: Any) -> str:
    """A prompt row's ``prompt`` as a sample shows it: the text, or one ``role: content`` line per message."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
    return str(prompt)
