"""A model that only ever runs forward (a frozen text encoder encoding a cache, inference): ``after_forward``
ends its step as ``after_backward`` ends a training step, so prefetching starts and ``gpu_memory_budget``
keeps units resident. Without it, every pass streams every unit on demand and the budget is never applied."""

from __future__ import annotations

import torch

from offload import OffloadOptions, OffloadTrainingManager
from tests.offload.models import WIDTH, Stack

DEPTH = 6


def _frozen() -> Stack:
    torch.manual_seed(0)
    return Stack(depth=DEPTH).requires_grad_(False)


def _block_bytes(model: Stack) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[1].parameters())


def _prefetched_before_forward(model: Stack, manager: OffloadTrainingManager) -> list[bool]:
    """Whether each block's weights were already on the device when its forward began (one pass)."""
    units = {u.name: u for u in manager._schedule.order}
    ready: list[bool] = []
    handles = [
        block.register_forward_pre_hook(
            lambda m, a, name=f"blocks.{i}": ready.append(units[name].resident) if name in units else None,
            prepend=True,
        )
        for i, block in enumerate(model.blocks)
    ]
    with torch.no_grad():
        model(torch.randn(4, WIDTH))
    manager.after_forward()
    for handle in handles:
        handle.remove()
    return ready


def test_after_forward_starts_prefetching_for_a_forward_only_model() -> None:
    model = _frozen()
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", prefetch=1))
    with torch.no_grad():
        model(torch.randn(4, WIDTH))
    manager.after_forward()
    assert not manager._schedule.recording
    for _ in range(2):
        ready = _prefetched_before_forward(model, manager)
        assert ready[1:] == [True] * (DEPTH - 1), ready  # every block but the pass's first was copied ahead
    assert manager.stats().device_bytes == 0  # nothing stays on the device after a pass (no budget)
    manager.remove()


def test_after_forward_applies_the_budget_and_matches_the_resident_output() -> None:
    model = _frozen()
    expected = model(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2)))
    budget = 2 * _block_bytes(model) + 64
    manager = OffloadTrainingManager(
        model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=budget)
    )
    outputs = []
    for _ in range(3):
        with torch.no_grad():
            outputs.append(model(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2))))
        manager.after_forward()
    held = manager.stats().device_bytes
    # The head, alone in its ring class, stays in its slot beside the blocks the budget pays for.
    head = sum(p.numel() * p.element_size() for p in model.head.parameters())
    assert _block_bytes(model) + head <= held <= budget + head
    assert manager._schedule.kept_outside_ring_bytes <= budget
    assert all(torch.equal(out, expected) for out in outputs)
    manager.remove()
