"""The seed's toy model: residual blocks of LayerNorm + Linear, trained to regress y = x + 1."""

from __future__ import annotations

import torch
from torch import nn

from jobs.spec import ToyMLPSpec


class ToyMLP(nn.Module):
    """``num_layers`` residual Linear layers of width ``hidden_size`` (the seed's ``ToyModel``)."""

    def __init__(self, hidden_size: int = 4096, num_layers: int = 10) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(nn.functional.layer_norm(x, (self.hidden_size,)))
        return x


def build_toy_mlp(spec: ToyMLPSpec, seed: int) -> ToyMLP:
    """A seeded ToyMLP on the CPU with PyTorch's default Linear init, as in the seed."""
    torch.manual_seed(seed)
    return ToyMLP(spec.hidden_size, spec.num_layers).to(getattr(torch, spec.dtype))


def toy_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of the prediction against ``y`` (computed in float32)."""
    prediction = model(batch["x"])
    return nn.functional.mse_loss(prediction.float(), batch["y"].float())
