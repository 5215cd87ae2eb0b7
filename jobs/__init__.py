"""Job specs, models, data and the training runner.

The names below are imported on first use (PEP 562), not with the package: ``import jobs.events`` or
``jobs.checkpoints.directory`` must not pull in torch, so that the service's API process, which reads events and
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
    from jobs.checkpoints.directory import CheckpointInfo, list_checkpoints
    from jobs.errors import JobSpecError, OutOfMemoryHint, SpecProblem
    from jobs.events import OffloadStats
    from jobs.fit.estimate import MemoryEstimate, estimate_memory
    from jobs.paths import PathRoots
    from jobs.spec.job import JobSpec, parse_bytes
    from jobs.spec.loading import job_spec_schema, line_of, load_job_spec
    from jobs.train.runner import JobOutcome, run_job, train_step

_HOME = {
    "CheckpointInfo": "jobs.checkpoints.directory",
    "list_checkpoints": "jobs.checkpoints.directory",
    "JobSpecError": "jobs.errors",
    "OutOfMemoryHint": "jobs.errors",
    "SpecProblem": "jobs.errors",
    "OffloadStats": "jobs.events",  # the engine's counters, as the job events carry them (torch-free)
    "MemoryEstimate": "jobs.fit.estimate",
    "estimate_memory": "jobs.fit.estimate",
    "job_spec_schema": "jobs.spec.loading",
    "line_of": "jobs.spec.loading",
    "load_job_spec": "jobs.spec.loading",
    "PathRoots": "jobs.paths",
    "JobOutcome": "jobs.train.runner",
    "run_job": "jobs.train.runner",
    "train_step": "jobs.train.runner",
    "JobSpec": "jobs.spec.job",
    "parse_bytes": "jobs.spec.job",  # the spec's sizes ("24GiB") as bytes
}
__all__ = [
    "CheckpointInfo",
    "JobOutcome",
    "JobSpec",
    "JobSpecError",
    "MemoryEstimate",
    "OffloadStats",
    "OutOfMemoryHint",
    "PathRoots",
    "SpecProblem",
    "estimate_memory",
    "job_spec_schema",
    "line_of",
    "list_checkpoints",
    "load_job_spec",
    "parse_bytes",
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
