"""Which units ``gpu_memory_budget`` keeps resident, and how the rest stream around them.

Kept units are spread over the forward order (first and last included) so the copy stream can run ahead
while each of them computes; the units that still stream take their ring slots in turn, and prefetching looks
past the resident ones.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadOptions, OffloadTrainingManager
from tests.offload.models import WIDTH, Stack

DEPTH = 9


def _stack(checkpointing: str | None = None) -> Stack:
    torch.manual_seed(0)
    model = Stack(depth=DEPTH, checkpointing=checkpointing)
    model.head.requires_grad_(False)  # frozen like the blocks: the budget may keep it too
    model.blocks.requires_grad_(False)
    model.blocks[0].norm.requires_grad_(True)  # something to train (kept on the device, never streamed)
    return model


def _block_bytes(model: Stack) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[1].parameters())


def _step(model: Stack, manager: OffloadTrainingManager) -> None:
    x = torch.randn(4, WIDTH)
    F.mse_loss(model(x), x).backward()
    manager.after_backward()


def _kept(manager: OffloadTrainingManager, *, in_ring: bool | None = None) -> list[int]:
    """Forward positions of the units whose frozen weights the budget holds for good: all of them, or those in
    a ring slot of their own (``in_ring=True``), or those in memory of their own (``False``)."""
    order = manager._schedule.order
    return [
        i
        for i, unit in enumerate(order)
        for o in [next((o for o in unit.offloaders if o.kind == "static" and o.holds > 0), None)]
        if o is not None and (in_ring is None or _in_ring(o) == in_ring)
    ]


def _in_ring(offloader: Any) -> bool:
    """Whether the offloader's device copy is placed in the ring (its own placement, or its span's)."""
    group = offloader.group
    return offloader.placement is not None or (group is not None and group.placement is not None)


def test_budget_keeps_units_spread_over_the_forward_order_ends_included() -> None:
    model = _stack()
    budget = 3 * _block_bytes(model) + 64  # three blocks (the head is as large as a block's layer: not small)
    manager = OffloadTrainingManager(
        model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=budget)
    )
    _step(model, manager)
    units = len(manager._schedule.order)
    # The first block (a layout of its own: its norm trains) and the head are alone in their ring classes and
    # stay in their slots, the step's first unit and the turnaround's; the blocks the budget pays for are spread
    # over the rest, the first and the last included.
    assert _kept(manager, in_ring=True) == [0, units - 1]
    kept = _kept(manager, in_ring=False)
    assert kept[0] == 1 and kept[-1] == units - 2 and len(kept) == 3, kept
    gaps = [b - a for a, b in itertools.pairwise(kept)]
    assert max(gaps) - min(gaps) <= 1, kept  # evenly spaced, not one run at the end of forward


@pytest.mark.parametrize("checkpointing", [None, "reentrant"])
def test_a_unit_alone_in_its_ring_slot_stays_there_free_of_the_budget(checkpointing: str | None) -> None:
    """The ring holds a slot for a unit in a class of its own (a head, an embedding) whatever the budget: kept,
    it stays in that slot, so the budget pays only for the units that leave the ring (before, the head left
    it too, and its bytes were held twice: in the ring and in memory of its own)."""
    model = _stack(checkpointing)
    reference = _stack(checkpointing)
    block = _block_bytes(model)
    manager = OffloadTrainingManager(
        model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=block + 64)
    )
    losses = []
    for _ in range(3):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
        loss = F.mse_loss(model(x), x)
        loss.backward()
        manager.after_backward()
        losses.append(loss.item())
    units = len(manager._schedule.order)
    assert _kept(manager, in_ring=True) == [0, units - 1] and len(_kept(manager, in_ring=False)) == 1
    ring = manager.ring.buffer
    for weight in (model.head.weight, model.blocks[0].fc1.weight):  # in the ring, not copies of their own
        assert ring.data_ptr() <= weight.data_ptr() < ring.data_ptr() + ring.numel()
    in_slot = sum(p.numel() * p.element_size() for p in [*model.head.parameters(), *model.blocks[0].parameters()]
                  if not p.requires_grad)  # fmt: skip
    schedule = manager._schedule
    assert schedule.kept_outside_ring_bytes <= block + 64 < schedule.kept_bytes
    assert schedule.kept_bytes == schedule.kept_outside_ring_bytes + in_slot
    assert manager.stats().kept_resident_bytes == schedule.kept_bytes
    expected = []
    for _ in range(3):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
        loss = F.mse_loss(reference(x), x)
        loss.backward()
        expected.append(loss.item())
    assert losses[0] == expected[0] and len(set(losses)) == 1  # frozen everywhere but a norm nothing steps
    manager.remove()


def test_small_units_are_kept_before_large_ones() -> None:
    model = _stack()
    model.blocks[0] = torch.nn.LayerNorm(WIDTH).requires_grad_(False)  # far under 1/16 of a block: small
    model.blocks[1].norm.requires_grad_(True)
    small = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    options = OffloadOptions(granularity="block", gpu_memory_budget=small + _block_bytes(model))
    manager = OffloadTrainingManager(model, "cpu", options=options)
    _step(model, manager)
    kept = [manager._schedule.order[i].name for i in _kept(manager)]
    assert kept[0] == "blocks.0", kept  # at the step's start, far from the turnaround: kept for being small


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_streamed_units_alternate_slots_and_are_prefetched_past_resident_ones(checkpointing: str | None) -> None:
    model = _stack(checkpointing)
    budget = 3 * _block_bytes(model) + 64
    options = OffloadOptions(granularity="block", prefetch=1, gpu_memory_budget=budget)
    manager = OffloadTrainingManager(model, "cpu", options=options)
    _step(model, manager)
    schedule = manager._schedule
    streamed = [u for u in schedule.order if id(u) in schedule.streaming and u.name.startswith("blocks.")]
    slots = [manager._placements[id(u)][1].slot for u in streamed]
    assert all(a is not b for a, b in itertools.pairwise(slots)), [u.name for u in streamed]
    # Before each streamed block's forward (but the step's first), its copy was already made.
    ready: list[bool] = []
    for unit in streamed:
        module = model.blocks[int(unit.name.split(".")[1])]
        module.register_forward_pre_hook(
            lambda m, a, unit=unit: None if torch._C._current_graph_task_id() != -1 else ready.append(unit.resident),
            prepend=True,
        )
    for _ in range(2):
        ready.clear()
        _step(model, manager)
        assert ready[1:] == [True] * (len(streamed) - 1), ready
    assert manager.stats().ring_overflows == 0
