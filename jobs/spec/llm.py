"""Spec sections for fine-tuning language models: record fields, preference objectives, evaluation, samples, tracking.

They mirror the YAML (``data.fields``, ``training.dpo``, ``training.orpo``, ``eval``, ``text_samples``, ``tracking``);
`jobs.spec.job` assembles them into
the job. A module of their own so the job spec stays one screen of model, data and training sections.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from jobs.spec.graders import Grader
from jobs.spec.sections import DataPath, Section, broken_rules


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


class GRPOSpec(Section):
    """Group Relative Policy Optimization; the names and meanings are TRL's ``GRPOConfig``'s (``max_new_tokens``
    is its ``max_completion_length``), the graders OpenAI's reinforcement fine-tuning's."""

    num_generations: int = Field(8, le=1024, description="completions sampled per prompt: the group (at least 2)")
    max_new_tokens: int = Field(256, gt=0, le=65536)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    beta: float = Field(0.0, ge=0, description="the KL weight to the reference (the base, LoRA adapters off)")
    epsilon: float = Field(0.2, gt=0, lt=1, description="the ratio's clip: 1 - epsilon to 1 + epsilon_high")
    epsilon_high: float | None = Field(None, gt=0, description="the upper clip (DAPO's); null: epsilon")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="grpo: mean per completion; dr_grpo: sum over completions * max_new_tokens; dapo: per token"
    )
    grader: Grader | None = Field(None, description="how completions are rewarded (OpenAI's grader objects)")
    samples_every_steps: int | None = Field(
        None, gt=0, description="every this many steps, report a few prompts' completions and rewards as samples"
    )
    samples_prompts: int = Field(2, gt=0, le=64, description="how many of the step's prompts those samples show")

    @field_validator("num_generations")
    @classmethod
    def _a_group(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                "training.grpo.num_generations must be at least 2: advantages compare a prompt's completions"
            )
        return value


class EarlyStoppingSpec(Section):
    """Stop when the eval loss has not improved by ``min_delta`` for ``patience`` evaluations in a row."""

    patience: int = Field(gt=0)
    min_delta: float = Field(0.0, ge=0)


class EvalSpec(Section):
    """Held-out evaluation: eval loss and perplexity (dpo/orpo: the pairs' loss and reward metrics) before the
    first step, every ``every_steps`` steps and at the end.

    Give ``split`` (a fraction of the training records held out, chosen by the seed) or ``path`` (records
    of the same format in their own file or directory), not both.
    """

    split: float | None = Field(None, gt=0, lt=1)
    path: DataPath | None = Field(None, description="a file or directory under a data root, same format as data")
    every_steps: int | None = Field(None, gt=0, description="null: only at the end (and at each checkpoint)")
    at_start: bool = Field(True, description="evaluate the base model at step 0 too, the figure to compare against")
    max_batches: int | None = Field(None, gt=0, description="cap each evaluation at this many batches")
    early_stopping: EarlyStoppingSpec | None = None

    @model_validator(mode="after")
    def _check_split_or_path(self) -> EvalSpec:
        if (self.split is None) == (self.path is None):
            raise broken_rules([("split", "give exactly one of eval.split (e.g. 0.05) and eval.path")])
        return self


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class SampleMessage(Section):
    """One turn of a chat prompt for text samples: its text, or (image-text models) OpenAI's content parts,
    ``[{type: image_url, image_url: {url: red.png}}, {type: text, text: ...}]``, an image's url a path beside the
    data or a ``data:`` URL."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def has_parts(self) -> bool:
        return isinstance(self.content, list)


class TextSamplesSpec(Section):
    """Fixed prompts completed greedily every ``every_steps`` steps. A prompt is a string (a chat user turn
    when the data is chat, an instruction when it is instruction data) or a list of chat messages (a system
    prompt too), rendered with the chat template and the assistant's header."""

    prompts: list[str | list[SampleMessage]] = Field(
        min_length=1, max_length=16, description="strings, or lists of {role, content} chat messages"
    )
    every_steps: int | None = Field(None, gt=0, description="null: only at the end")
    max_new_tokens: int = Field(64, gt=0, le=2048)

    @field_validator("prompts", mode="before")
    @classmethod
    def _check_prompts(cls, value: Any) -> Any:
        # Checked here, before pydantic tries each kind of prompt, so a problem is named once, at its message.
        if not isinstance(value, list):
            return value
        problems = []
        for index, prompt in enumerate(value):
            if isinstance(prompt, list):
                found = _conversation_problems(prompt)
                problems += [(".".join(filter(None, (str(index), where))), message) for where, message in found]
            elif not isinstance(prompt, str):
                problems.append((str(index), "must be a string or a list of {role, content} chat messages"))
        if problems:
            raise broken_rules(problems)
        return value

    def has_chat_prompts(self) -> bool:
        """Whether a prompt is a list of chat messages (rendered with a chat template)."""
        return any(isinstance(prompt, list) for prompt in self.prompts)


def _conversation_problems(messages: list[Any]) -> list[tuple[str, str]]:
    """(path within the prompt, problem) for a chat prompt: roles, non-empty contents, a user turn last."""
    if not messages:
        return [("", "a chat prompt needs at least one message, e.g. [{role: user, content: ...}]")]
    problems = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            problems.append((str(index), f"must be a {{role, content}} message; got {message!r:.60}"))
        elif message["role"] not in CHAT_ROLES:
            problems.append((f"{index}.role", f"must be one of {', '.join(CHAT_ROLES)}; got {message['role']!r:.40}"))
        elif isinstance(message["content"], list):
            problems += _parts_problems(message["content"], f"{index}.content")
        elif not isinstance(message["content"], str) or not message["content"].strip():
            problems.append((f"{index}.content", "must be non-empty text"))
    if not problems and messages[-1]["role"] == "assistant":
        problems.append(
            (
                f"{len(messages) - 1}.role",
                "the model writes the next assistant turn; end a chat prompt with a user turn",
            )
        )
    return problems


def _parts_problems(parts: list[Any], where: str) -> list[tuple[str, str]]:
    """A sample prompt's content parts: OpenAI's ``{type: text, text}`` and ``{type: image_url, image_url: {url}}``."""
    if not parts:
        return [(where, "must be non-empty text or a non-empty list of content parts")]
    for number, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and set(part) == {"type", "text"} and isinstance(part["text"], str):
            continue
        url = part.get("image_url") if isinstance(part, dict) else None
        plain_url = isinstance(url, dict) and isinstance(url.get("url"), str) and set(url) <= {"url", "detail"}
        if kind == "image_url" and set(part) == {"type", "image_url"} and plain_url:
            continue
        return [
            (
                f"{where}.{number}",
                "must be {type: text, text} or {type: image_url, image_url: {url: <a path beside the data or a data: "
                f"URL>}}; got {part!r:.60}",
            )
        ]
    return []


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
