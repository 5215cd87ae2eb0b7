"""Experiment tracking: the job's events written to TensorBoard, and to MLflow or W&B when asked for.

`Tracking` sits in front of the job's ``report`` callback: every event still goes to Ferry's own store,
and step, eval and sample events are also written with each tool's own writer. TensorBoard uses
``torch.utils.tensorboard`` (the ``tensorboard`` package); MLflow and W&B are optional extras
(``ferry[mlflow]``, ``ferry[wandb]``), imported only when the spec asks for them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from jobs.errors import Problem
from jobs.events import CheckpointEvent, EvalEvent, FinishedEvent, JobEvent, LogEvent, Report, SampleEvent, StepEvent

log = logging.getLogger(__name__)
TENSORBOARD_DIR = "tensorboard"
_RUN_IDS = "tracking_runs.json"  # MLflow / W&B run ids, so a resumed job logs into the same run


def missing_tracking_packages(tracking: Any) -> list[Problem]:
    """(spec path, message) for each tracker the spec turns on whose package is not installed."""
    problems = []
    for name, wanted, package in (
        ("mlflow", tracking.mlflow is not None, "mlflow"),
        ("wandb", tracking.wandb is not None, "wandb"),
    ):
        if wanted and not _importable(package):
            problems.append((f"tracking.{name}", f"needs the {package} package: pip install 'ferry[{name}]'"))
    return problems


class Tracking:
    """A ``report`` callback that also writes metrics to the trackers of ``spec.tracking``.

    Args:
        spec: The job spec.
        output_dir: The job's output directory (TensorBoard files, file stores and run ids go under it).
        report: Where every event goes first.
    """

    def __init__(self, spec: Any, output_dir: Path, report: Report) -> None:
        self.report, self.output_dir = report, Path(output_dir)
        self.writers: list[Any] = []
        tracking = spec.tracking
        if tracking.tensorboard:
            if _importable("tensorboard"):
                from torch.utils.tensorboard import SummaryWriter

                self.writers.append(_TensorBoard(SummaryWriter(str(self.output_dir / TENSORBOARD_DIR))))
            else:
                message = "tracking.tensorboard skipped: the tensorboard package is not installed"
                log.warning(message)
                report(LogEvent(level="warning", message=message))
        runs = self._run_ids()
        if tracking.mlflow is not None:
            self.writers.append(_MLflow(tracking.mlflow, spec, self.output_dir, runs))
        if tracking.wandb is not None:
            self.writers.append(_Wandb(tracking.wandb, spec, self.output_dir, runs))
        if runs:
            (self.output_dir / _RUN_IDS).write_text(json.dumps(runs))

    def __call__(self, event: JobEvent) -> None:
        self.report(event)
        scalars: dict[str, float] = {}
        if isinstance(event, StepEvent):
            scalars = {"train/loss": event.loss, "train/lr": event.lr}
            if event.tokens_per_s is not None:
                scalars["train/tokens_per_s"] = event.tokens_per_s
            if event.preference is not None:  # TRL's names: train/rewards/chosen, train/logps/rejected, ...
                for name, value in event.preference.model_dump().items():
                    scalars["train/" + name.replace("_", "/", 1)] = value
        elif isinstance(event, EvalEvent):
            scalars = {"eval/loss": event.eval_loss}
            if event.perplexity is not None:
                scalars["eval/perplexity"] = event.perplexity
            if event.preference is not None:  # eval/rewards/chosen, eval/logps/rejected, ... as for training
                for name, value in event.preference.model_dump().items():
                    scalars["eval/" + name.replace("_", "/", 1)] = value
        for writer in self.writers:
            if scalars and isinstance(event, StepEvent | EvalEvent):
                writer.scalars(scalars, event.step)
            if isinstance(event, SampleEvent) and event.text is not None:
                writer.sample(event.prompt or "", event.text, event.step)
            if isinstance(event, EvalEvent | CheckpointEvent | FinishedEvent):
                writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            try:
                writer.close()
            except Exception:  # a tracker failing at the end must not fail a trained job
                log.exception("closing %s failed", type(writer).__name__)

    def _run_ids(self) -> dict[str, str]:
        path = self.output_dir / _RUN_IDS
        return json.loads(path.read_text()) if path.exists() else {}


def _importable(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def _sample_markdown(prompt: str, text: str) -> str:
    return f"**{prompt}**\n\n    {text}"


class _TensorBoard:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def scalars(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def sample(self, prompt: str, text: str, step: int) -> None:
        self.writer.add_text("samples", _sample_markdown(prompt, text), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, options: Any, spec: Any, output_dir: Path, runs: dict[str, str]) -> None:
        import mlflow

        self.mlflow = mlflow
        if options.tracking_uri is None:
            # The default is a file store under the job's output (no server, no database). MLflow 3 keeps it
            # in maintenance mode and refuses it unless this is set; the job's process is the only reader.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(options.tracking_uri or (output_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(options.experiment)
        run = mlflow.start_run(run_id=runs.get("mlflow"), run_name=None if "mlflow" in runs else spec.name)
        if "mlflow" not in runs:
            mlflow.log_dict(spec.model_dump(mode="json"), "spec.json")
        runs["mlflow"] = run.info.run_id

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({name.replace("/", "_"): value for name, value in values.items()}, step=step)

    def sample(self, prompt: str, text: str, step: int) -> None:
        self.count = getattr(self, "count", 0) + 1
        self.mlflow.log_text(_sample_markdown(prompt, text), f"samples/step-{step:08d}-{self.count}.md")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.mlflow.end_run()


class _Wandb:
    def __init__(self, options: Any, spec: Any, output_dir: Path, runs: dict[str, str]) -> None:
        import wandb

        self.run = wandb.init(
            project=options.project,
            mode=options.mode,
            dir=str(output_dir),
            name=spec.name,
            id=runs.get("wandb"),
            resume="allow",
            config=spec.model_dump(mode="json"),
        )
        runs["wandb"] = self.run.id

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def sample(self, prompt: str, text: str, step: int) -> None:
        self.run.log({"samples": _sample_markdown(prompt, text)}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()
