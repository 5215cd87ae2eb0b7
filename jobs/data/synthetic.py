"""The seed's synthetic regression data: x ~ N(0, 1), y = x + offset."""

from __future__ import annotations

import torch


class SyntheticRegression:
    """An endless source of batches; batch ``i`` depends only on (seed, i), so any position resumes exactly."""

    batches_per_epoch: int | None = None
    tokens_per_sample: int | None = None

    def __init__(self, dim: int, batch_size: int, offset: float, seed: int) -> None:
        self.dim, self.batch_size, self.offset, self.seed = dim, batch_size, offset, seed

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """The ``index``-th micro-batch (CPU tensors)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x = torch.randn((self.batch_size, self.dim), generator=generator)
        return {"x": x, "y": x + self.offset}
