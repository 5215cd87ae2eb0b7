"""The seed's synthetic regression data."""

from __future__ import annotations

import torch

from jobs.data import SyntheticRegression


def test_batches_are_seeded_by_position() -> None:
    source = SyntheticRegression(dim=4, batch_size=3, offset=1.0, seed=0)
    batch = source.batch(2)
    assert batch["x"].shape == (3, 4) and torch.equal(batch["y"], batch["x"] + 1)
    assert torch.equal(SyntheticRegression(4, 3, 1.0, 0).batch(2)["x"], batch["x"])
    assert not torch.equal(source.batch(3)["x"], batch["x"])
    assert source.batches_per_epoch is None
