"""``gpu_memory_budget="auto"``: the engine measures the budget after the second step (auto_budget.py) and
then keeps units as a budget set by hand would, without changing a single value of training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadOptions, OffloadTrainingManager, auto_budget
from tests.offload.models import WIDTH, Stack

DEPTH = 9


def _stack(checkpointing: str | None = None) -> Stack:
    torch.manual_seed(0)
    model = Stack(depth=DEPTH, checkpointing=checkpointing)
    model.requires_grad_(False)
    model.blocks[0].norm.requires_grad_(True)  # something to train
    return model


def _block_bytes(model: Stack) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[1].parameters())


def _train(model: Stack, manager: OffloadTrainingManager | None, steps: int, kept: list[set[int]]) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, WIDTH)
        loss = F.mse_loss(model(x), x)
        loss.backward()
        if manager is not None:
            manager.after_backward()
            kept.append(set(manager._schedule.kept))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_auto_keeps_what_the_measurement_allows_from_step_two_and_trains_bitwise_alike(
    monkeypatch: pytest.MonkeyPatch, checkpointing: str | None
) -> None:
    model = _stack(checkpointing)
    reference = copy.deepcopy(model)
    room = 2 * _block_bytes(model) + 64
    measured_on: list[int] = []

    def measure(device: torch.device, limit: int | None) -> int:
        measured_on.append(limit or 0)
        return room

    monkeypatch.setattr(auto_budget, "measured_budget", measure)
    options = OffloadOptions(granularity="block", gpu_memory_budget="auto")
    manager = OffloadTrainingManager(model, "cpu", options=options)
    kept: list[set[int]] = []
    losses = _train(model, manager, steps=4, kept=kept)
    assert measured_on == [0], "measured once, after step 2"
    assert kept[0] == set(), "step 1 records with every unit streaming"
    assert kept[1] and kept[1] == kept[2] == kept[3], "kept from step 2 on, and never changed after"
    held = sum(o.nbytes for u in manager._schedule.order for o in u.offloaders if id(o) in kept[1])
    paid = manager._schedule.kept_outside_ring_bytes  # units alone in their ring slot stay there for nothing
    assert room - _block_bytes(model) < paid <= room < held, (paid, room, held)  # filled to within one more block
    assert manager.measured_budget == room
    assert manager.stats().kept_resident_bytes == held, "the step events say what the budget keeps"
    streams = [u.name for u in manager._schedule.order if u.streams]
    assert streams and len(streams) < len(manager._schedule.order)
    assert losses == _train(reference, None, steps=4, kept=[])


def test_auto_on_the_cpu_measures_nothing_and_streams_every_unit() -> None:
    assert auto_budget.measured_budget(torch.device("cpu"), None) is None
    model = _stack()
    reference = copy.deepcopy(model)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(gpu_memory_budget="auto"))
    kept: list[set[int]] = []
    losses = _train(model, manager, steps=3, kept=kept)
    assert kept == [set(), set(), set()]
    assert manager.measured_budget is None
    assert losses == _train(reference, None, steps=3, kept=[])


def test_a_budget_that_is_neither_a_size_nor_auto_names_both() -> None:
    with pytest.raises(ValueError, match="gpu_memory_budget must be a byte count.*or 'auto'"):
        OffloadOptions(gpu_memory_budget="lots")
    assert OffloadOptions(gpu_memory_budget="auto", gpu_memory_limit="1GiB").gpu_memory_budget == "auto"


@pytest.mark.gpu
def test_auto_on_a_gpu_keeps_units_and_stays_under_the_limit() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run `pytest -m gpu` on a GPU box")
    from offload import set_gpu_memory_limit

    # Something larger ran in this process before (as the earlier GPU tests do): its peak must not count.
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.empty_cache()
    model = _stack()
    limit = torch.cuda.memory_reserved() + (1 << 30)
    options = OffloadOptions(granularity="block", gpu_memory_budget="auto", gpu_memory_limit=limit)
    manager = OffloadTrainingManager(model, "cuda", options=options)
    try:
        kept: list[set[int]] = []
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for _ in range(4):
            x = torch.randn(4, WIDTH, device="cuda")
            F.mse_loss(model(x), x).backward()
            manager.after_backward()
            kept.append(set(manager._schedule.kept))
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        assert manager.measured_budget is not None and 0 < manager.measured_budget < limit
        assert kept[0] == set() and kept[1] and kept[1] == kept[3], "a tiny model under 1 GiB keeps its frozen units"
        assert torch.cuda.memory_reserved() <= limit
    finally:
        manager.remove()
        set_gpu_memory_limit(torch.device("cuda"), None)  # the next tests get the whole device back
