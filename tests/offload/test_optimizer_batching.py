"""The CPU optimizer's worker steps a unit's landed updates in one optimizer call (``attach_optimizer``).

A block's parameters (norm, two linears with biases: six tensors) reach the host together; stepping them one
call each costs the optimizer's Python overhead six times. The worker takes every landed update of the unit
it picks and steps them together, which must give the same bits as per-parameter calls."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadTrainingManager
from tests.offload.models import WIDTH, make_stack

STEPS = 3


def resident(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(8, WIDTH, generator=generator)
        F.mse_loss(model(x), x + 1).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def offloaded_with_a_backlog(model: torch.nn.Module, checkpointing: str | None) -> tuple[dict, int, int]:
    """Exact optimizer offload, with the worker held back through each backward (as when the CPU update is
    the slower side): every update is queued before the worker picks one. Returns the weights, the
    optimizer calls per step and the number of units with trainable parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer)
    stepper = manager._stepper
    assert stepper is not None
    generator = torch.Generator().manual_seed(1)
    calls = []
    for _ in range(STEPS):
        x = torch.randn(8, WIDTH, generator=generator)
        before = stepper.optimizer_calls
        with stepper._cond:  # the worker waits on this condition; holding it keeps the worker out
            F.mse_loss(model(x), x + 1).backward()
            manager.after_backward()
            optimizer.step()
            optimizer.zero_grad()
        manager.wait_for_optimizer()
        calls.append(stepper.optimizer_calls - before)
    units = {stepper._priority(o) for o in stepper._offloaders}
    manager.remove()
    assert len(set(calls)) == 1, calls
    return {k: v.clone() for k, v in model.state_dict().items()}, calls[0], len(units)


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_a_units_updates_are_one_call_and_the_same_bits(checkpointing: str | None) -> None:
    model = make_stack("full", checkpointing)
    expected = resident(copy.deepcopy(model))
    params = sum(1 for _ in model.parameters())
    got, calls, units = offloaded_with_a_backlog(model, checkpointing)
    assert calls == units < params  # per-parameter calls would be one per tensor
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_updates_of_different_hyperparameters_are_not_stepped_together() -> None:
    model = make_stack("full", None)
    block = model.blocks[0]
    decay = [block.fc1.weight, block.fc2.weight]
    rest = [p for p in model.parameters() if all(p is not d for d in decay)]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.AdamW(
        [
            {"params": [reference.blocks[0].fc1.weight, reference.blocks[0].fc2.weight]},
            {
                "params": [
                    p
                    for n, p in reference.named_parameters()
                    if n not in ("blocks.0.fc1.weight", "blocks.0.fc2.weight")
                ],
                "weight_decay": 0.0,
            },
        ],
        lr=1e-2,
    )
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer)
    stepper = manager._stepper
    assert stepper is not None
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    with stepper._cond:
        F.mse_loss(model(x), x + 1).backward()
        manager.after_backward()
        optimizer.step()
    manager.wait_for_optimizer()
    units = {stepper._priority(o) for o in stepper._offloaders}
    pairs = {(stepper._priority(o), id(stepper._group_of[id(o.tensor)])) for o in stepper._offloaders}
    assert len(pairs) > len(units)  # block 0's units hold parameters of both groups
    assert stepper.optimizer_calls == len(pairs)  # one call per unit and group
    manager.remove()
    F.mse_loss(reference(x), x + 1).backward()
    ref_optimizer.step()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
