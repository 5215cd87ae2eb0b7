"""One process's part of the CPU optimizer when data-parallel ranks share its work (ZeRO-1 under optimizer offload).

Every rank holds the whole model, so every rank's host masters hold every weight; the optimizer's state (AdamW's
two moments, twice the weights) and the gradients it reads need only be held once across the ranks. With
``optimizer_shard=OptimizerShard(rank, world_size)`` the engine gives each trainable host weight's flat
elements to the ranks in ``world_size`` contiguous parts of ``ceil(numel / world_size)`` elements (the last part
shorter, or empty), as FSDP2 splits each parameter: every rank holds about ``1 / world_size`` of every weight's
optimizer state and gradient buffer, so the ranks' shares are balanced by bytes, and a part depends only on the
weight's size, the rank and the world size. This process's gradient buffer holds its part, its CPU optimizer
steps its part of the master, and its optimizer state has that part's shape.

Whoever runs the ranks moves what crosses them: before the engine copies a gradient to the host
(``register_gradient_hook``) it writes the ranks' averaged part into ``param.grad`` at its place (a
reduce-scatter); after the step (``register_step_hook``) it writes the other ranks' updated parts into this
process's masters (an all-gather). The engine needs no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class ParamPart:
    """The elements ``[start, stop)`` of a flat weight that one rank steps; every rank's part spans ``chunk``
    elements before it is cut at the weight's end (what a reduce-scatter or all-gather pads to)."""

    start: int
    stop: int
    chunk: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (weight-shaped, contiguous), as a flat view."""
        return tensor.view(-1)[self.start : self.stop]


@dataclass(frozen=True)
class OptimizerShard:
    """This process is rank ``rank`` of ``world_size`` ranks that split the CPU optimizer's work.

    Example:
        >>> OptimizerShard(rank=1, world_size=2).part(5)
        ParamPart(start=3, stop=5, chunk=3)
    """

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"optimizer_shard needs 0 <= rank < world_size; got rank {self.rank} of {self.world_size}")

    def part(self, numel: int, rank: int | None = None) -> ParamPart:
        """The part of a weight of ``numel`` elements that ``rank`` (default: this process's) steps."""
        rank = self.rank if rank is None else rank
        chunk = -(-numel // self.world_size)
        start = min(rank * chunk, numel)
        return ParamPart(start, min(start + chunk, numel), chunk)


class HostedPart(NamedTuple):
    """A trainable weight whose optimizer runs on the host: the parameter, its host master, this rank's part."""

    param: torch.Tensor
    master: torch.Tensor
    part: ParamPart
