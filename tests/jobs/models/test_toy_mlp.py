"""The seed's toy model."""

from __future__ import annotations

import torch

from jobs.models import build_model
from jobs.models.toy_mlp import ToyMLPSpec


def test_toy_matches_the_seed_shape_and_loss() -> None:
    model, loss_fn = build_model(ToyMLPSpec(kind="toy_mlp", hidden_size=8, num_layers=2), seed=0)
    assert [type(m).__name__ for m in model.layers] == ["Linear", "Linear"]
    x = torch.randn(4, 8)
    loss = loss_fn(model, {"x": x, "y": x + 1})
    expected = torch.nn.functional.mse_loss(model(x), x + 1)
    assert torch.equal(loss, expected)


def test_seeded_default_init() -> None:
    a, _ = build_model(ToyMLPSpec(kind="toy_mlp", hidden_size=8, num_layers=2), seed=5)
    b, _ = build_model(ToyMLPSpec(kind="toy_mlp", hidden_size=8, num_layers=2), seed=5)
    assert torch.equal(a.layers[1].weight, b.layers[1].weight)
