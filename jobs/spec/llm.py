"""Spec sections for fine-tuning language models: record fields, preference objectives, evaluation, samples, tracking.

They mirror the YAML (``data.fields``, ``training.dpo``, ``training.orpo``, ``eval``, ``text_samples``, ``tracking``);
`jobs.spec.job` assembles them into
the job. A module of their own so the job spec stays one screen of model, data and training sections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from jobs.spec.sections import Section, broken_rules, confined_path


class InstructionFields(Section):
    """Field names of an instruction record (alpaca's ``instruction`` / ``input`` / ``output`` by default)."""

    instruction: str = "instruction"
    input: str = Field("input", description="optional per record; an empty or absent input is left out")
    output: str = "output"


class DPOSpec(Section):
    """Direct Preference Optimization; the names and meanings are TRL's ``DPOConfig``'s."""

    beta: float = Field(0.1, gt=0, description="how far the policy may move from the reference (KL weight)")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="sigmoid: the DPO paper's; ipo: squared, per completion token; hinge: SLiC's"
    )
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="sigmoid only: the chance a label is flipped")


class ORPOSpec(Section):
    """Odds Ratio Preference Optimization: the completion NLL of the chosen rows plus ``beta`` times the odds-ratio
    loss. ``beta`` is the ORPO paper's lambda, named as in TRL's ``ORPOConfig``."""

    beta: float = Field(0.1, gt=0, description="the weight of the odds-ratio term (the paper's lambda)")


class EarlyStoppingSpec(Section):
    """Stop when the eval loss has not improved by ``min_delta`` for ``patience`` evaluations in a row."""

    patience: int = Field(gt=0)
    min_delta: float = Field(0.0, ge=0)


class EvalSpec(Section):
    """Held-out evaluation: eval loss and perplexity before the first step, every ``every_steps`` steps and at
    the end.

    Give ``split`` (a fraction of the training records held out, chosen by the seed) or ``path`` (records
    of the same format in their own file or directory), not both.
    """

    split: float | None = Field(None, gt=0, lt=1)
    path: Path | None = Field(None, description="a file or directory under a data root, same format as data")
    every_steps: int | None = Field(None, gt=0, description="null: only at the end (and at each checkpoint)")
    at_start: bool = Field(True, description="evaluate the base model at step 0 too, the figure to compare against")
    max_batches: int | None = Field(None, gt=0, description="cap each evaluation at this many batches")
    early_stopping: EarlyStoppingSpec | None = None

    @field_validator("path")
    @classmethod
    def _confine_path(cls, value: Any, info: ValidationInfo) -> Any:
        return confined_path(value, info, "data")

    @model_validator(mode="after")
    def _check_split_or_path(self) -> EvalSpec:
        if (self.split is None) == (self.path is None):
            raise broken_rules([("split", "give exactly one of eval.split (e.g. 0.05) and eval.path")])
        return self


class TextSamplesSpec(Section):
    """Fixed prompts completed greedily every ``every_steps`` steps (chat-formatted when the data is chat)."""

    prompts: list[str] = Field(min_length=1, max_length=16)
    every_steps: int | None = Field(None, gt=0, description="null: only at the end")
    max_new_tokens: int = Field(64, gt=0, le=2048)


class MlflowSpec(Section):
    """Log to MLflow (extra ``ferry[mlflow]``): a tracking URI, or a file store under the job's output."""

    tracking_uri: str | None = Field(None, description="null: file store at <output>/mlruns")
    experiment: str = "ferry"


class WandbSpec(Section):
    """Log to Weights & Biases (extra ``ferry[wandb]``); ``offline`` needs no network or account."""

    project: str = "ferry"
    mode: Literal["offline", "online"] = "offline"


class TrackingSpec(Section):
    """Where metrics go besides Ferry's own events: TensorBoard files, MLflow, W&B."""

    tensorboard: bool = Field(True, description="event files under <output>/tensorboard")
    mlflow: MlflowSpec | None = None
    wandb: WandbSpec | None = None
