"""Which units ``gpu_memory_budget`` keeps resident, and how the rest stream around them.

Kept units are spread over the forward order (first and last included) so the copy stream can run ahead
while each of them computes; the units that still stream take their ring slots in turn, and prefetching looks
past the resident ones.
"""

from __future__ import annotations

import itertools

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


def _kept(manager: OffloadTrainingManager) -> list[int]:
    """Forward positions of the units whose frozen weights the budget holds for good."""
    order = manager._schedule.order
    return [i for i, unit in enumerate(order) if any(o.kind == "static" and o.holds > 0 for o in unit.offloaders)]


def test_budget_keeps_units_spread_over_the_forward_order_ends_included() -> None:
    model = _stack()
    budget = 3 * _block_bytes(model) + 64  # three blocks (the head is as large as a block's layer: not small)
    manager = OffloadTrainingManager(
        model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=budget)
    )
    _step(model, manager)
    kept = _kept(manager)
    units = len(manager._schedule.order)
    assert kept[0] == 0 and kept[-1] == units - 1, kept  # the step's first unit and the turnaround's
    gaps = [b - a for a, b in itertools.pairwise(kept)]
    assert max(gaps) - min(gaps) <= 1, kept  # evenly spaced, not one run at the end of forward


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
