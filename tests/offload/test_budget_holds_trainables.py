"""With optimizer offload, a memory budget left over after the frozen weights holds trainable weights from
their forward to their backward (schedule.py): each is copied to the device once a step instead of twice,
and training is unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadOptions, OffloadTrainingManager
from tests.offload.models import WIDTH, make_stack


def _run(
    budget: int | None, checkpointing: str | None, attach: bool, device: str = "cpu"
) -> tuple[list[float], dict, list[int]]:
    model = make_stack("full", checkpointing)
    manager = None
    if budget != -1:
        options = OffloadOptions(gpu_memory_budget=budget)
        manager = OffloadTrainingManager(model, device, enable_optimizer_cpu_offload=True, options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if manager is not None and attach:
        manager.attach_optimizer(optimizer)
    generator = torch.Generator().manual_seed(1)
    losses, copied = [], []
    for _ in range(4):
        x = torch.randn(8, WIDTH, generator=generator).to(device)
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        losses.append(loss.item())
        if manager is not None:
            manager.after_backward()
            copied.append(manager.stats().last_step_h2d_bytes)
        optimizer.step()
        optimizer.zero_grad()
    if manager is not None:
        manager.remove()
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, copied


@pytest.mark.parametrize("attach", [False, True], ids=["optimizer-after", "attach_optimizer"])
def test_held_trainables_are_copied_once_a_step_and_train_the_same(attach: bool) -> None:
    weights = sum(p.numel() * p.element_size() for p in make_stack("full", None).parameters())
    expected = _run(-1, None, attach=False)
    streamed = _run(None, None, attach)
    held = _run(1 << 30, None, attach)
    for got in (streamed, held):
        assert got[0] == expected[0]
        for name, value in expected[1].items():
            assert torch.equal(got[1][name], value), name
    # Without a budget every trainable master is copied in forward and again for backward (less the last
    # unit, kept for backward anyway); with one, step 2 on (the budget applies after step 1) copies each once.
    assert streamed[2][-1] > 1.5 * weights
    assert held[2][0] == streamed[2][0] and held[2][-1] == weights


def test_the_budget_holds_only_what_fits() -> None:
    model = make_stack("full", None)
    layer = sum(p.numel() * p.element_size() for p in model.blocks[0].fc1.parameters())
    options = OffloadOptions(gpu_memory_budget=layer)  # room for one of the blocks' fc1 units, no more
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randn(8, WIDTH)
        F.mse_loss(model(x), x).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
    assert 0 < manager._schedule.held_for_backward_bytes <= layer
    manager.remove()


def test_a_checkpointed_forward_saves_no_weights_so_nothing_is_held_across_it() -> None:
    """Under checkpointing the backward's recompute copies again whatever the budget says; training is
    still exact."""
    expected = _run(-1, "non_reentrant", attach=False)
    held = _run(1 << 30, "non_reentrant", attach=False)
    assert held[0] == expected[0]
    for name, value in expected[1].items():
        assert torch.equal(held[1][name], value), name


@pytest.mark.gpu
@pytest.mark.parametrize("attach", [False, True], ids=["optimizer-after", "attach_optimizer"])
def test_held_trainables_train_bitwise_as_streamed_ones_on_gpu(attach: bool) -> None:
    """The same CPU optimizer over the same gradients: holding the device copies (no second copy, memory of
    their own instead of the ring) changes nothing in the numbers."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run `pytest -m gpu` on a GPU box")
    streamed = _run(None, None, attach, device="cuda")
    held = _run(1 << 30, None, attach, device="cuda")
    assert held[0] == streamed[0]
    for name, value in streamed[1].items():
        assert torch.equal(held[1][name], value), name
    assert held[2][-1] < streamed[2][-1]
