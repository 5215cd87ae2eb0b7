"""Graphs that change between steps: a parameter a step does not use gets no update and keeps ``grad=None``,
exactly as without offload; a manager removed and replaced mid-training continues bitwise; weights keep
their layout. Every case is compared bitwise with the same loop without a manager."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload import OffloadOptions, OffloadTrainingManager
from tests.offload.models import WIDTH


class DynamicStack(nn.Module):
    """Blocks run in an order the caller picks per step; any subset may be skipped (layer drop), and a
    side branch is used on some steps only."""

    def __init__(self, depth: int = 4, checkpointing: str | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(depth)
        )
        self.branch = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.checkpointing = checkpointing
        self.order: list[int] = list(range(depth))
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "reentrant":
            x = x.detach().requires_grad_()
        for index in self.order:
            block = self.blocks[index]
            if self.checkpointing and torch.is_grad_enabled():
                x = x + checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = x + block(x)
        if self.use_branch:
            x = x + self.branch(x)
        return self.head(x)


Plan = Callable[[DynamicStack, int], None]


def layer_drop(model: DynamicStack, step: int) -> None:
    keep = torch.Generator().manual_seed(100 + step)
    model.order = [i for i in range(len(model.blocks)) if torch.rand((), generator=keep) > 0.4]


def shuffled_order(model: DynamicStack, step: int) -> None:
    model.order = torch.randperm(len(model.blocks), generator=torch.Generator().manual_seed(step)).tolist()


def branch_some_steps(model: DynamicStack, step: int) -> None:
    model.use_branch = step % 3 == 0


PLANS = [
    pytest.param(layer_drop, id="layer-drop"),
    pytest.param(shuffled_order, id="order-changes-every-step"),
    pytest.param(branch_some_steps, id="branch-some-steps"),
]


def run(
    plan: Plan,
    *,
    checkpointing: str | None,
    offload: dict | None,
    steps: int = 7,
    attach: bool = False,
    set_to_none: bool = True,
    replace_manager_at: int | None = None,
    device: str = "cpu",
) -> tuple[list[float], dict[str, torch.Tensor], list[list[str]]]:
    """Train; returns losses, the final state and, per step, the names of parameters with ``grad=None``
    when the optimizer steps."""
    torch.manual_seed(0)
    model = DynamicStack(checkpointing=checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def attach_manager() -> OffloadTrainingManager | None:
        if offload is None:
            return None
        manager = OffloadTrainingManager(model, device, **offload)
        if attach:
            manager.attach_optimizer(optimizer)
        return manager

    manager = attach_manager()
    generator = torch.Generator().manual_seed(1)
    losses, no_grad = [], []
    for step in range(steps):
        if step == replace_manager_at and manager is not None:
            manager.remove()
            manager = attach_manager()
        plan(model, step)
        x = torch.randn(8, WIDTH, generator=generator).to(device)
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        losses.append(loss.item())
        if manager is not None:
            manager.after_backward()
        no_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    if manager is not None:
        manager.remove()
    return losses, {k: v.to("cpu").clone() for k, v in model.state_dict().items()}, no_grad


def assert_same(reference: tuple, offloaded: tuple) -> None:
    ref_losses, ref_state, ref_no_grad = reference
    losses, state, no_grad = offloaded
    assert no_grad == ref_no_grad
    assert losses == ref_losses
    for name in ref_state:
        assert torch.equal(state[name], ref_state[name]), name


OFFLOADS = [
    pytest.param({"enable_optimizer_cpu_offload": True}, False, id="optimizer-offload"),
    pytest.param({"enable_optimizer_cpu_offload": True}, True, id="optimizer-offload+attach"),
    pytest.param({"enable_optimizer_cpu_offload": True, "options": OffloadOptions(prefetch=2)}, False, id="prefetch2"),
    pytest.param({}, False, id="optimizer-on-device"),
]


@pytest.mark.parametrize(("offload", "attach"), OFFLOADS)
@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("plan", PLANS)
def test_unused_parameters_get_no_update_and_no_grad(
    plan: Plan, checkpointing: str | None, offload: dict, attach: bool
) -> None:
    reference = run(plan, checkpointing=checkpointing, offload=None)
    if plan is not shuffled_order:
        assert any(names for names in reference[2]), "the plan must leave some parameter unused on some step"
    assert_same(reference, run(plan, checkpointing=checkpointing, offload=offload, attach=attach))


@pytest.mark.parametrize("plan", PLANS)
def test_zero_grad_to_zeros_keeps_matching(plan: Plan) -> None:
    """``zero_grad(set_to_none=False)``: unused parameters keep a zero gradient, and AdamW still moves them
    by their momentum, with and without offload."""
    reference = run(plan, checkpointing=None, offload=None, set_to_none=False)
    offloaded = run(plan, checkpointing=None, offload={"enable_optimizer_cpu_offload": True}, set_to_none=False)
    assert_same(reference, offloaded)


@pytest.mark.parametrize(("offload", "attach"), OFFLOADS)
@pytest.mark.parametrize("plan", PLANS)
def test_remove_and_a_new_manager_continue_as_if_never_removed(plan: Plan, offload: dict, attach: bool) -> None:
    reference = run(plan, checkpointing=None, offload=None)
    for at in (1, 3):
        assert_same(reference, run(plan, checkpointing=None, offload=offload, attach=attach, replace_manager_at=at))


class Transposed(nn.Module):
    """A weight stored transposed (as a tied or converted checkpoint may leave it): non-contiguous."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2 * WIDTH, WIDTH).t(), requires_grad=trainable)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x @ self.weight)


@pytest.mark.parametrize("offload", [{}, {"enable_optimizer_cpu_offload": True}], ids=["device-opt", "cpu-opt"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_a_weight_keeps_its_strides_on_the_device(trainable: bool, offload: dict) -> None:
    torch.manual_seed(0)
    model = Transposed(trainable)
    strides = model.weight.stride()
    assert not model.weight.is_contiguous()
    seen: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.weight.stride()))
    manager = OffloadTrainingManager(model, "cpu", **offload)
    assert model.weight.stride() == strides  # the host copy
    model(torch.randn(4, WIDTH)).sum().backward()
    manager.after_backward()
    if model.weight.grad is not None:
        assert model.weight.grad.stride() == strides
    manager.remove()
    assert seen == [strides]
    assert model.weight.stride() == strides


@pytest.mark.gpu
@pytest.mark.parametrize("attach", [False, True], ids=["step", "attach"])
@pytest.mark.parametrize("plan", PLANS)
def test_unused_parameters_on_gpu(plan: Plan, attach: bool) -> None:
    """On a GPU: the same parameters get no gradient as in plain CPU training, and the losses stay close
    (GPU kernels round differently, so not bitwise)."""
    reference = run(plan, checkpointing="non_reentrant", offload=None)
    offloaded = run(
        plan,
        checkpointing="non_reentrant",
        offload={"enable_optimizer_cpu_offload": True},
        attach=attach,
        device="cuda",
    )
    assert offloaded[2] == reference[2]
    torch.testing.assert_close(torch.tensor(offloaded[0]), torch.tensor(reference[0]), rtol=1e-3, atol=1e-4)
