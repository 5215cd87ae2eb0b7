"""An OpenAI fine-tuning request (``POST /v1/fine_tuning/jobs``) as a Ferry job spec.

What OpenAI's request names maps onto the spec; what it leaves to the server takes Ferry's defaults:

- ``model``: a Hugging Face model directory under a model root (``model: {kind: hf_causal_lm, path}``), its
  tokenizer read from the same directory; a vision-language model (its config.json has a ``vision_config``:
  base_model.py) is ``model: {kind: hf_image_text_to_text, path}``, its processor read from the directory;
- ``training_file`` / ``validation_file``: uploaded files (``data.path`` / ``eval.path`` name them by id);
  a chat file trains ``data.format: chat``, a preference file ``data.format: preference``; for a
  vision-language model a chat file, with images in OpenAI's vision format or without, trains
  ``data.kind: image_chat``, and a file with images is refused for a text model;
- ``hyperparameters`` (or ``method.<type>.hyperparameters``): ``n_epochs`` → ``training.epochs`` and ``batch_size``
  → ``training.batch_size`` (auto: ``auto``, which the checker chooses from the data by OpenAI's rules, see
  jobs/data/auto_size.py, and the job's events say why), ``learning_rate_multiplier`` → ``training.learning_rate``
  as a multiple of Ferry's 1e-4 (auto: 1); DPO's ``beta`` → ``training.dpo.beta`` (auto: 0.1);
- ``method: reinforcement``: prompt rows (``messages`` ending before the reply, and the columns the grader reads)
  train ``training.objective: grpo`` with the request's grader (openai/reinforcement.py maps the graders and the
  reinforcement hyperparameters, and refuses what Ferry cannot do);
- ``seed`` → ``training.seed`` (a random one when absent, shown on the job); ``suffix`` names the job;
- LoRA on ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` at Ferry's rank, no offload, the fit check on;
- ``ferry``: anything else, as spec sections merged over the above (``{lora: null}`` trains in full,
  ``{offload: {enable_model_cpu_offload: true}}`` streams the weights).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from service.api.errors import ApiError
from service.api.openai.reinforcement import (
    BASE_GENERATIONS,
    ferry_grader,
    num_generations,
    refuse_unsupported,
)

BASE_LEARNING_RATE = 1e-4  # Ferry's training.learning_rate, which learning_rate_multiplier scales
AUTO_BETA = 0.1
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # Llama, Qwen, Mistral and Gemma name them so
FILE_ID = r"^file-[0-9a-f]{1,64}$"
Auto = Literal["auto"]
# What pydantic inserts in a location for the member of a union it tried: int, float, literal['auto'], ...
_UNION_MEMBER = re.compile(r"^(int|float|str|bool|none|[a-z-]+\[.*\])$")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _strict_number(value: Any, info: ValidationInfo) -> Any:
    """``auto``, null, or a number that is a number: JSON ``true`` is no epoch count (pydantic takes it for 1)."""
    if value is None or value == "auto":
        return value
    whole = info.field_name in ("n_epochs", "batch_size", "eval_interval", "eval_samples")
    if isinstance(value, bool) or not isinstance(value, int | float) or (whole and not float(value).is_integer()):
        kind = "a whole number" if whole else "a number"
        raise ValueError(f'must be {kind} above 0 or "auto"; got {json.dumps(value)}')
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f'must be above 0 or "auto"; got {value}')
    return int(value) if whole else float(value)


class Hyperparameters(_Body):
    n_epochs: int | Auto | None = Field("auto", description="auto: chosen from the data, as OpenAI's auto")
    batch_size: int | Auto | None = Field("auto", description="auto: chosen from the data, as OpenAI's auto")
    learning_rate_multiplier: float | Auto | None = Field("auto", description="times Ferry's 1e-4; auto: 1")

    _numbers = field_validator("n_epochs", "batch_size", "learning_rate_multiplier", mode="before")(_strict_number)


class DpoHyperparameters(Hyperparameters):
    beta: float | Auto | None = Field("auto", description="auto: 0.1")

    _beta = field_validator("beta", mode="before")(_strict_number)


class ReinforcementHyperparameters(Hyperparameters):
    compute_multiplier: float | Auto | None = Field("auto", description="times 8 completions per prompt; auto: 1")
    eval_interval: int | Auto | None = Field("auto", description="only auto: grpo jobs run no evaluation")
    eval_samples: int | Auto | None = Field("auto", description="only auto: grpo jobs run no evaluation")
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = Field("default", description="only default")

    _more = field_validator("compute_multiplier", "eval_interval", "eval_samples", mode="before")(_strict_number)


class Reinforcement(_Body):
    grader: dict[str, Any] = Field(description="OpenAI's grader object (openai/reinforcement.py maps it)")
    hyperparameters: ReinforcementHyperparameters = ReinforcementHyperparameters()


class Supervised(_Body):
    hyperparameters: Hyperparameters = Hyperparameters()


class Dpo(_Body):
    hyperparameters: DpoHyperparameters = DpoHyperparameters()


class Method(_Body):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: Supervised | None = None
    dpo: Dpo | None = None
    reinforcement: Reinforcement | None = None


class FineTuningCreate(_Body):
    """The body of ``POST /v1/fine_tuning/jobs``: OpenAI's fields, and ``ferry`` for spec sections."""

    model: str = Field(min_length=1, max_length=255, description="a model directory under a model root")
    training_file: str = Field(pattern=FILE_ID)
    validation_file: str | None = Field(None, pattern=FILE_ID)
    suffix: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]*$")
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    integrations: list[Any] | None = None
    ferry: dict[str, Any] | None = Field(None, description="spec sections merged over the translated spec")

    @property
    def method_type(self) -> str:
        return self.method.type if self.method else "supervised"

    def chosen_hyperparameters(self) -> Hyperparameters:
        """The method's hyperparameters, or the top-level ones (OpenAI's older form)."""
        section = getattr(self.method, self.method_type, None) if self.method else None
        return section.hyperparameters if section else (self.hyperparameters or Hyperparameters())


def parse_create(body: bytes) -> FineTuningCreate:
    """The request, or a 400 naming the first bad parameter."""
    try:
        return FineTuningCreate.model_validate_json(body or b"{}")
    except ValidationError as error:
        first = error.errors()[0]
        param = request_param(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise request_error(param, f"{param}: {message}" if param else message) from None


def request_param(loc: tuple[Any, ...]) -> str | None:
    """The request's field path of a pydantic location, without the union members pydantic names in it
    (``hyperparameters.n_epochs.int`` is ``hyperparameters.n_epochs``)."""
    parts = [str(part) for part in loc if not _UNION_MEMBER.match(str(part))]
    return ".".join(parts) or None


def build_spec(
    create: FineTuningCreate, *, training_format: str | None, seed: int, image_text: bool = False
) -> dict[str, Any]:
    """The Ferry spec for ``create`` (see the module docstring), ``ferry`` merged over it; ``image_text``: the
    base model is a vision-language model."""
    _refuse_unsupported(create, training_format)
    chosen = create.chosen_hyperparameters()
    training: dict[str, Any] = {
        "epochs": _given(chosen.n_epochs, "auto"),
        "batch_size": _given(chosen.batch_size, "auto"),
        "seed": seed,
    }
    training["learning_rate"] = BASE_LEARNING_RATE * _given(chosen.learning_rate_multiplier, 1.0)
    if create.method_type == "dpo":
        beta = _given(getattr(chosen, "beta", None), AUTO_BETA)
        training.update(objective="dpo", dpo={"beta": beta})
    if create.method_type == "reinforcement":
        training.update(_reinforcement(create, chosen))
    spec: dict[str, Any] = {
        "name": _name(create),
        "model": {"kind": "hf_causal_lm", "path": create.model},
        "data": {
            "kind": "text",
            "path": create.training_file,
            "format": _FORMATS[create.method_type],
            "tokenizer": {"kind": "hf", "path": create.model},
        },
        "lora": {"target_modules": list(LORA_TARGETS)},  # on a vision-language model: its language model's
        "training": training,
    }
    if image_text:
        if create.method_type != "supervised":
            raise _bad("method.type", f"a vision-language model fine-tunes supervised here; got {create.method_type}")
        spec["model"]["kind"] = "hf_image_text_to_text"
        spec["data"] = {"kind": "image_chat", "path": create.training_file}
    if create.validation_file:
        spec["eval"] = {"path": create.validation_file}
    return merge(spec, create.ferry or {})


_FORMATS = {"supervised": "chat", "dpo": "preference", "reinforcement": "prompt"}
_ROWS = {
    "chat": "(messages)",
    "preference": "(input, preferred_output, non_preferred_output)",
    "prompt": "(messages ending before the assistant's reply, and the columns the grader reads)",
}


def _reinforcement(create: FineTuningCreate, chosen: Any) -> dict[str, Any]:
    """The training section's grpo part of a reinforcement request."""
    assert create.method is not None and create.method.reinforcement is not None  # _refuse_unsupported saw to it
    refuse_unsupported(chosen, create.validation_file)
    grpo = {
        "grader": ferry_grader(create.method.reinforcement.grader),
        "num_generations": num_generations(chosen.compute_multiplier),
    }
    return {"objective": "grpo", "grpo": grpo}


def resolved_method(create: FineTuningCreate, spec: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``method`` with the values the job trains with: ``spec`` is the checked spec (``auto`` chosen,
    ``ferry`` applied)."""
    training = spec.get("training") or {}
    hyperparameters: dict[str, Any] = {
        "n_epochs": training.get("epochs", "auto"),
        "batch_size": training.get("batch_size", 1),
        "learning_rate_multiplier": training.get("learning_rate", BASE_LEARNING_RATE) / BASE_LEARNING_RATE,
    }
    if create.method_type == "dpo":
        hyperparameters["beta"] = (training.get("dpo") or {}).get("beta", AUTO_BETA)
    section: dict[str, Any] = {"hyperparameters": hyperparameters}
    if create.method_type == "reinforcement":
        assert create.method is not None and create.method.reinforcement is not None
        generations = (training.get("grpo") or {}).get("num_generations", BASE_GENERATIONS)
        hyperparameters.update(
            compute_multiplier=generations / BASE_GENERATIONS,
            eval_interval="auto",
            eval_samples="auto",
            reasoning_effort="default",
        )
        section["grader"] = create.method.reinforcement.grader
    return {"type": create.method_type, create.method_type: section}


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` over ``base``, mappings merged key by key; a ``None`` value removes the key."""
    merged = dict(base)
    for key, value in overrides.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def new_seed() -> int:
    return secrets.randbelow(2**31)


def _refuse_unsupported(create: FineTuningCreate, training_format: str | None) -> None:
    if create.integrations:
        raise _bad("integrations", "integrations are not supported; set ferry: {tracking: {wandb: {...}}} instead")
    kind = create.method_type
    if create.method and kind != "supervised" and create.hyperparameters:
        raise _bad("hyperparameters", f"give a {kind} job's hyperparameters in method.{kind}.hyperparameters")
    for other in _FORMATS:
        if create.method and other != kind and getattr(create.method, other) is not None:
            raise _bad(f"method.{other}", f"is given for a {kind} job; put the settings in method.{kind}")
    if create.method and getattr(create.method, kind) is None and kind == "reinforcement":
        raise _bad("method.reinforcement", "a reinforcement job needs method.reinforcement.grader")
    wanted = _FORMATS[kind]
    if training_format == "image_chat" and kind != "supervised":
        raise _bad("training_file", f"holds chat rows with images, which train supervised jobs; this is a {kind} job")
    if training_format is not None and training_format not in (wanted, "image_chat"):
        raise _bad(
            "training_file", f"holds {training_format} rows; a {kind} job trains on {wanted} rows {_ROWS[wanted]}"
        )


def _given(value: Any, auto: Any) -> Any:
    return auto if value is None or value == "auto" else value


def _name(create: FineTuningCreate) -> str:
    stem = create.suffix or create.model.rstrip("/").rsplit("/", 1)[-1]
    return ("ft-" + re.sub(r"[^A-Za-z0-9._-]+", "-", stem))[:128]


def _bad(param: str, message: str) -> ApiError:
    return request_error(param, f"{param}: {message}")


def request_error(param: str | None, message: str) -> ApiError:
    """A 400 naming the request's ``param`` (``@param`` as its problem's path: see ``errors.param_of``)."""
    return ApiError(
        400, "invalid_request", message, problems=[{"path": f"@{param}" if param else "", "message": message}]
    )
