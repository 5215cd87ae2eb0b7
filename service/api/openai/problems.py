"""A generated spec's problems in the request's own words: ``POST /v1/fine_tuning/jobs`` builds a Ferry spec the
user never wrote, so a refusal must not say ``training.batch_size (line 23)``. Each spec path the request set
becomes its field (``hyperparameters.batch_size``, ``training_file``, ``model``, ...), any other spec path the
``ferry`` field it can be set through (``ferry.data.seq_len``), YAML lines are dropped, an upload's server path
is its file id, and the same problem twice (the model and its tokenizer read from one directory) is said once.

Example:
    raise in_request_terms(error, create, uploads_dir=settings.uploads_dir)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from service.api.openai.create import BASE_LEARNING_RATE, FineTuningCreate
from service.api.openai.reinforcement import request_param as reinforcement_param
from service.errors import ApiError

# The spec's top-level sections (jobs.spec.job.JobSpec): a dotted word starting with one is a spec path.
_SECTIONS = "model|data|lora|training|offload|distributed|checkpoint|eval|text_samples|tracking|task|cache|sample"
_SPEC_PATH = re.compile(rf"(?<![\w.])(?:ferry\.)?((?:{_SECTIONS})(?:\.[A-Za-z_]\w*)+)")
_LINE = re.compile(r" \(line \d+\)")


def request_fields(create: FineTuningCreate) -> dict[str, str]:
    """Spec path → the request field it came from; hyperparameters where the request gave them."""
    section = getattr(create.method, create.method_type, None) if create.method else None
    hyper = f"method.{create.method_type}.hyperparameters" if section is not None else "hyperparameters"
    return {
        "data.path": "training_file",
        "eval.path": "validation_file",
        "model.path": "model",
        "data.tokenizer.path": "model",
        "training.epochs": f"{hyper}.n_epochs",
        "training.batch_size": f"{hyper}.batch_size",
        "training.learning_rate": f"{hyper}.learning_rate_multiplier",
        "training.dpo.beta": "method.dpo.hyperparameters.beta",
        "training.seed": "seed",
        "name": "suffix",
    }


def in_request_terms(error: ApiError, create: FineTuningCreate, *, uploads_dir: Path) -> ApiError:
    """``error`` (a refusal of the generated spec) with its message and problems in the request's fields; the
    first problem's field is the answer's ``param`` (``errors.param_of`` reads ``@field``)."""
    fields = request_fields(create)
    uploads = f"{uploads_dir.resolve()}/"
    grader = create.method.reinforcement.grader if create.method and create.method.reinforcement else None

    def field(path: str) -> str | None:
        return fields.get(path) or (reinforcement_param(path, grader) if grader is not None else None)

    def words(text: str) -> str:
        text = _LINE.sub("", text)
        text = re.sub(re.escape(uploads) + r"(file-[0-9a-f]+)/[^\s;,)']*", r"\1", text)
        return _SPEC_PATH.sub(lambda m: _field(m.group(1), fields, field(m.group(1))), text)

    if not error.problems or all(str(p.get("path") or "").startswith("@") for p in error.problems):
        return ApiError(
            error.status_code, error.code, words(error.message), problems=error.problems, headers=error.headers
        )
    said: list[str] = []
    problems: list[dict[str, Any]] = []
    for problem in error.problems:
        path = str(problem.get("path") or "")
        param = field(path) or (f"ferry.{path}" if path else None)
        hint = f"; did you mean '{problem['suggestion']}'?" if problem.get("suggestion") else ""
        message = words(str(problem.get("message") or "")) + hint
        text = f"{param}: {message}" if param else message
        if text not in said:
            said.append(text)
            problems.append(
                {
                    "path": f"@{param}" if param else "",
                    "message": message,
                    "line": None,
                    "suggestion": problem.get("suggestion"),
                }
            )
    return ApiError(error.status_code, error.code, "; ".join(said), problems=problems, headers=error.headers)


def _field(path: str, fields: dict[str, str], found: str | None) -> str:
    if path == "training.learning_rate":  # the spec's rate is the multiplier times Ferry's base rate
        return f"the learning rate ({fields[path]} × {BASE_LEARNING_RATE:g})"
    return found or f"ferry.{path}"
