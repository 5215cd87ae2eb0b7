"""The seed's toy model: residual blocks of LayerNorm + Linear, trained to regress y = x + 1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field
from torch import nn

from jobs.models.family import ModelFamily, activation_element_size, linear_module_names
from jobs.spec.sections import Dtype, Section

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec


class ToyMLPSpec(Section):
    """The seed's toy model: ``num_layers`` residual blocks of LayerNorm + Linear(hidden, hidden)."""

    kind: Literal["toy_mlp"]
    hidden_size: int = Field(4096, gt=0)
    num_layers: int = Field(10, gt=0)
    dtype: Dtype = "float32"


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


def meta_toy_mlp(spec: ToyMLPSpec) -> ToyMLP:
    """The model's shapes on the meta device."""
    with torch.device("meta"):
        return ToyMLP(spec.hidden_size, spec.num_layers)


def toy_activation_bytes(spec: JobSpec, model: nn.Module) -> int:
    """Saved per layer: the norm's input and output (the Linear's input); the residual sum is the next
    layer's input. Then the prediction, target and difference of the float32 loss."""
    assert isinstance(spec.model, ToyMLPSpec)
    n, h, layers = spec.training.batch_size, spec.model.hidden_size, spec.model.num_layers
    return n * h * (activation_element_size(spec) * (2 * layers + 1) + 4 * 3)


FAMILY = ModelFamily(
    kind="toy_mlp",
    spec=ToyMLPSpec,
    build=build_toy_mlp,
    loss=toy_loss,
    data_kinds=("synthetic_regression",),
    meta_model=meta_toy_mlp,
    activation_bytes=toy_activation_bytes,
    lora_target_names=lambda spec: linear_module_names(meta_toy_mlp(spec)),
    shrink_hint="model.hidden_size",
    synthetic_width=lambda spec: spec.hidden_size,
)
