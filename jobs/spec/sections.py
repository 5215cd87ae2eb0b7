"""What every spec section shares: the base model, the dtype names, collected rule errors, confined paths.

A module of its own so that the model families (jobs/models/*.py), which define their own spec sections,
and jobs/spec/job.py, which assembles the whole job from them, can both import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo
from pydantic_core import PydanticCustomError

from jobs.errors import Problem
from jobs.paths import confine

Dtype = Literal["float32", "bfloat16", "float16"]


class Section(BaseModel):
    """Base of every spec section: unknown keys are refused, specs are immutable, floats are finite.

    ``allow_inf_nan=False``: ``.inf``, ``1e400`` and ``.nan`` would train a NaN model that "succeeds".
    Booleans read as numbers and integers beyond int64 are refused by ``jobs.spec.values``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def broken_rules(problems: list[Problem]) -> PydanticCustomError:
    """One validation error carrying several (relative path, message) problems; loading.py expands it.

    Pydantic stops at the first error an after-validator raises, so rules that want every violation
    reported collect them and raise this once.
    """
    return PydanticCustomError("spec_rules", "{count} rule(s) broken", {"count": len(problems), "problems": problems})


def confined_path(value: Any, info: ValidationInfo, kind: Literal["model", "data"]) -> Any:
    """Resolve a path against the roots passed as validation context (see `load_job_spec`)."""
    roots = (info.context or {}).get("roots")
    if value is None or roots is None:
        return value
    return confine(value, roots.model_roots if kind == "model" else roots.data_roots, kind)


def _within_roots(kind: Literal["model", "data"]) -> Callable[[Path, ValidationInfo], Path]:
    def confine_to_roots(value: Path, info: ValidationInfo) -> Path:
        return confined_path(value, info, kind)

    return confine_to_roots


# The two kinds of path a spec names, each checked against its roots wherever a section declares one (a path
# outside them, or missing, is refused with the roots that were searched).
ModelPath = Annotated[Path, AfterValidator(_within_roots("model"))]  # a file or directory under a model root
DataPath = Annotated[Path, AfterValidator(_within_roots("data"))]  # a file or directory under a data root
