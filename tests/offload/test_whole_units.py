"""``OffloadOptions.whole_units``: a named module streams as one unit in one copy, whatever the granularity."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import OffloadOptions, OffloadTrainingManager, plan_memory


class TowerAndDecoder(nn.Module):
    """A frozen "tower" of repeated blocks feeding a trainable decoder, as a vision-language model is laid out."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8) for _ in range(2)]))
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.tower.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tower[0](x)
        for block in self.tower[1]:
            x = torch.relu(block(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_a_whole_unit_is_one_flat_unit_and_trains_as_without_it(granularity: str) -> None:
    torch.manual_seed(0)
    resident = TowerAndDecoder()
    offloaded = copy.deepcopy(resident)
    options = OffloadOptions(granularity=granularity, whole_units=("tower",))
    plan = plan_memory(offloaded, options=options)
    names = [unit.name for unit in plan.units]
    assert names.count("tower") == 1 and not any(name.startswith("tower.") for name in names)  # before: tower.0, ...
    assert len(plan.units[names.index("tower")].tensors) == 6  # three weights, three biases, in one unit
    manager = OffloadTrainingManager(offloaded, "cpu", options=options)
    x = torch.randn(4, 8)
    resident(x).square().sum().backward()
    offloaded(x).square().sum().backward()
    manager.after_backward()
    for (name, a), b in zip(resident.named_parameters(), offloaded.parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, msg=name)
    manager.remove()
