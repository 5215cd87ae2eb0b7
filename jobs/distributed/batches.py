"""Each rank's rows of the global batch: together the ranks see exactly what one rank would with the
global batch size."""

from __future__ import annotations

import torch

from jobs.data import BatchSource


class RankShard:
    """Rows ``rank::world_size`` of every batch of ``source``, a source built with the global batch size.

    Taking every ``world_size``-th row (not a contiguous block) keeps a preference batch's layout (chosen rows
    then rejected rows, pair ``i`` at rows ``i`` and ``n + i``): the global batch holds ``world_size *
    batch_size`` pairs, so a pair's two rows land on the same rank, in the same order. Every rank reads the
    whole global batch and keeps its rows: the data's position and order are those of one rank, so a job
    resumes on any number of ranks at the same place.
    """

    def __init__(self, source: BatchSource, *, rank: int, world_size: int) -> None:
        if source.batch_size % world_size:
            raise ValueError(f"a global batch of {source.batch_size} rows does not split over {world_size} ranks")
        self.source, self.rank, self.world_size = source, rank, world_size

    @property
    def batch_size(self) -> int:
        return self.source.batch_size // self.world_size

    @property
    def batches_per_epoch(self) -> int | None:
        return self.source.batches_per_epoch

    @property
    def tokens_per_sample(self) -> int | None:
        return self.source.tokens_per_sample

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """This rank's rows of global batch ``index``."""
        return {name: self._rows(name, tensor) for name, tensor in self.source.batch(index).items()}

    def _rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:  # a per-batch scalar, the same on every rank
            return tensor
        if tensor.shape[0] % self.world_size:
            raise ValueError(
                f"batch field {name!r} has {tensor.shape[0]} rows, which do not split over {self.world_size} ranks"
            )
        return tensor[self.rank :: self.world_size].contiguous()

    def __getattr__(self, name: str) -> object:
        return getattr(self.source, name)  # the family's own extras (an eval set, a bucket plan)
