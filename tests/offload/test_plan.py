"""The memory plan (plan.py) and the device ring it sizes (ring.py).

On the CPU target the ring is a real tensor and every copy's destination is checked against it, so the whole
placement logic runs without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload import MemoryPlan, OffloadOptions, OffloadTrainingManager, plan_memory
from tests.offload.models import WIDTH, make_stack


def plan_for(method: str, granularity: str, prefetch: int, optimizer_offload: bool = False) -> MemoryPlan:
    return plan_memory(
        make_stack(method, "non_reentrant"),
        enable_optimizer_cpu_offload=optimizer_offload,
        options=OffloadOptions(granularity=granularity, prefetch=prefetch),
    )


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("method, optimizer_offload", [("adapter", False), ("full", True)])
def test_block_units_never_plan_more_device_memory_than_leaf_units(
    method: str, optimizer_offload: bool, prefetch: int
) -> None:
    leaf = plan_for(method, "leaf", prefetch, optimizer_offload)
    block = plan_for(method, "block", prefetch, optimizer_offload)
    assert 0 < block.ring_bytes <= leaf.ring_bytes
    # Both stream the same bytes per pass; only how they are grouped differs.
    assert block.streamed_bytes == pytest.approx(leaf.streamed_bytes, rel=0.05)


def test_ring_is_prefetch_depth_times_each_layout() -> None:
    plan = plan_for("adapter", "block", prefetch=1)
    blocks = [c for c in plan.ring_classes if c.members == 3]  # the three repeated blocks share one layout
    assert len(blocks) == 1 and blocks[0].depth == 2
    slots = [layout.slot for layout in plan.layouts if layout.ring_class == plan.ring_classes.index(blocks[0])]
    assert slots == [0, 1, 0]
    deeper = plan_for("adapter", "block", prefetch=5)
    assert [c.depth for c in deeper.ring_classes if c.members == 3] == [3]  # never more slots than members


def test_the_engine_builds_what_the_plan_says() -> None:
    model = make_stack("full", "non_reentrant")
    options = OffloadOptions(granularity="block")
    plan = plan_memory(model, enable_optimizer_cpu_offload=True, options=options)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, options=options)
    assert manager.arena.reserved_bytes == plan.pinned_reserved_bytes
    assert manager.arena.requested_bytes == plan.pinned_requested_bytes
    assert manager.stats().planned_device_bytes == plan.ring_bytes == manager.ring.nbytes
    manager.remove()


def _ring_range(manager: OffloadTrainingManager) -> range:
    start = manager.ring.buffer.data_ptr()
    return range(start, start + manager.ring.nbytes)


@pytest.mark.parametrize("granularity", ["leaf", "block"])
@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_steady_state_copies_land_in_the_ring(granularity: str, checkpointing: str | None, prefetch: int) -> None:
    model = make_stack("adapter", checkpointing)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity=granularity, prefetch=prefetch))
    ring = _ring_range(manager)
    destinations: list[bool] = []
    original = manager._copies.to_device

    def recording(host: torch.Tensor, **kwargs: object) -> object:
        pending = original(host, **kwargs)
        destinations.append(pending.tensor.data_ptr() in ring)
        return pending

    manager._copies.to_device = recording  # type: ignore[method-assign]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(4):
        x = torch.randn(8, WIDTH)
        F.mse_loss(model(x), x + 1).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
    assert destinations and all(destinations)
    assert manager.stats().ring_overflows == 0
    manager.remove()


def test_a_slot_held_by_another_unit_overflows_to_allocator_memory_and_is_counted() -> None:
    model = make_stack("adapter", None)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", prefetch=1))
    first, _, third = manager.units[:3]  # blocks 0 and 2 share slot 0 of the block class
    first.onload()
    third.onload()
    assert manager.stats().ring_overflows == 1
    ring = _ring_range(manager)
    assert first.offloaders[0].device_copy.data_ptr() in ring
    assert third.offloaders[0].device_copy.data_ptr() not in ring
    third.offload()
    first.offload()
    third.onload()  # the slot is free again: back in the ring
    assert third.offloaders[0].device_copy.data_ptr() in ring
    third.offload()
    manager.remove()


def test_a_plan_beyond_the_limit_is_refused_at_setup() -> None:
    model = make_stack("adapter", None)
    plan = plan_memory(model, options=OffloadOptions(granularity="block", prefetch=1))
    with pytest.raises(ValueError, match=r"device ring for streamed weights needs .* but gpu_memory_limit is"):
        OffloadTrainingManager(
            model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_limit=plan.ring_bytes - 1)
        )


def test_plan_works_on_the_meta_device_without_memory() -> None:
    with torch.device("meta"):
        model = make_stack("full", None)
    plan = plan_memory(model, enable_optimizer_cpu_offload=True)
    reference = plan_memory(make_stack("full", None), enable_optimizer_cpu_offload=True)
    assert (plan.ring_bytes, plan.pinned_reserved_bytes) == (reference.ring_bytes, reference.pinned_reserved_bytes)


class SameSizedLeaves(torch.nn.Module):
    """Blocks whose three projections have the same size (like a gated MLP's gate, up and down)."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))) for _ in range(depth)
        )
        self.requires_grad_(False)
        self.head = torch.nn.Linear(WIDTH, WIDTH)  # trainable, kept on the device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return self.head(x)


@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_same_sized_leaves_of_one_block_never_share_a_slot(granularity: str) -> None:
    model = SameSizedLeaves()
    x = torch.randn(4, WIDTH, requires_grad=True)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity=granularity))
    for _ in range(3):
        model(x).sum().backward()
        manager.after_backward()
    assert manager.stats().ring_overflows == 0
    leaf = plan_memory(SameSizedLeaves(), options=OffloadOptions(granularity="leaf"))
    assert manager.plan.ring_bytes <= leaf.ring_bytes
    manager.remove()
