"""The ``distributed:`` section: how many data-parallel ranks train the job."""

from __future__ import annotations

from pydantic import Field

from jobs.spec.sections import Section

MAX_WORLD_SIZE = 64  # ranks of one machine


class DistributedSpec(Section):
    """Data parallelism on one machine: ``world_size`` ranks (one per GPU; processes on the CPU), each with
    the whole model and ``training.batch_size`` rows of every global batch, gradients averaged each step. The
    global batch is ``world_size * batch_size * gradient_accumulation_steps`` samples."""

    world_size: int = Field(
        1,
        ge=1,
        le=MAX_WORLD_SIZE,
        description="ranks (GPUs) training the job; each reads training.batch_size rows of every global batch",
    )
