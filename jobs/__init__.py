"""Job specs, models, data and the training runner.

Example:
    >>> from jobs import load_job_spec, run_job
    >>> spec = load_job_spec(open("configs/cpu_smoke.yaml").read())
    >>> run_job(spec, output_dir="out/smoke", report=print)
"""

from jobs.checkpoint import CheckpointInfo, list_checkpoints
from jobs.errors import JobSpecError, OutOfMemoryHint, SpecProblem
from jobs.estimate import MemoryEstimate, estimate_memory
from jobs.loading import job_spec_schema, line_of, load_job_spec
from jobs.paths import PathRoots
from jobs.runner import JobOutcome, run_job, train_step
from jobs.spec import JobSpec

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
]
