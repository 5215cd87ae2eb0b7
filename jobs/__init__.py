"""Job specs, models, data and the training runner.

The names below are imported on first use (PEP 562), not with the package: ``import jobs.events`` or
``jobs.checkpoint`` must not pull in torch, so that the service's API process, which reads events and
checkpoint manifests, stays free of it (only the spec checker and job processes import torch).

Example:
    >>> from jobs import load_job_spec, run_job
    >>> spec = load_job_spec(open("configs/cpu_smoke.yaml").read())
    >>> run_job(spec, output_dir="out/smoke", report=print)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobs.checkpoint import CheckpointInfo, list_checkpoints
    from jobs.errors import JobSpecError, OutOfMemoryHint, SpecProblem
    from jobs.estimate import MemoryEstimate, estimate_memory
    from jobs.loading import job_spec_schema, line_of, load_job_spec
    from jobs.paths import PathRoots
    from jobs.runner import JobOutcome, run_job, train_step
    from jobs.spec import JobSpec

_HOME = {
    "CheckpointInfo": "jobs.checkpoint",
    "list_checkpoints": "jobs.checkpoint",
    "JobSpecError": "jobs.errors",
    "OutOfMemoryHint": "jobs.errors",
    "SpecProblem": "jobs.errors",
    "MemoryEstimate": "jobs.estimate",
    "estimate_memory": "jobs.estimate",
    "job_spec_schema": "jobs.loading",
    "line_of": "jobs.loading",
    "load_job_spec": "jobs.loading",
    "PathRoots": "jobs.paths",
    "JobOutcome": "jobs.runner",
    "run_job": "jobs.runner",
    "train_step": "jobs.runner",
    "JobSpec": "jobs.spec",
}
__all__ = [
    "CheckpointInfo",
    "JobOutcome",
    "JobSpec",
    "JobSpecError",
    "MemoryEstimate",
    "OutOfMemoryHint",
    "PathRoots",
    "SpecProblem",
    "estimate_memory",
    "job_spec_schema",
    "line_of",
    "list_checkpoints",
    "load_job_spec",
    "run_job",
    "train_step",
]  # the names of _HOME


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'jobs' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
