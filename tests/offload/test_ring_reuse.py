"""A ring slot that still holds a unit's frozen weights is not copied into again (ring.py): at the step's two
turnarounds the last units through each slot are the first ones needed. Reuse must never hand out stale
bytes: a weight written in place, another unit's copy into the slot, or a buffer a forward updated all
force a fresh copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import OffloadOptions, OffloadTrainingManager
from tests.offload.models import WIDTH, Adapter, Stack, make_stack, train

CHECKPOINTING = [None, "non_reentrant", "reentrant"]
GRANULARITIES = [OffloadOptions(granularity="block"), OffloadOptions()]


def _deep_stack(checkpointing: str | None) -> Stack:
    """Six blocks with adapters: more units than the two slots of the ring, so slots change hands within a
    step, and a frozen base that the backward needs again (the adapters' input gradients)."""
    torch.manual_seed(0)
    model = Stack(depth=6, checkpointing=checkpointing)
    model.requires_grad_(False)
    for block in model.blocks:
        block.fc1 = Adapter(block.fc1)
    return model


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_turnarounds_reuse_the_slots_and_copy_less(checkpointing: str | None) -> None:
    """From step 2 on (step 1 records the order), each step copies fewer bytes than two passes over the
    frozen blocks: what it did not copy is counted as reused, and the two add up to those two passes."""
    model = _deep_stack(checkpointing)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    block_span = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters() if not p.requires_grad)
    head = sum(p.numel() * p.element_size() for p in model.head.parameters())
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", prefetch=1))
    reused_before = 0
    for step in range(4):
        x = torch.randn(8, WIDTH)
        F.mse_loss(model(x), x).backward()
        manager.after_backward()
        stats = manager.stats()
        reused = stats.reused_bytes - reused_before
        reused_before = stats.reused_bytes
        if step == 0:
            continue
        # Every frozen weight is needed twice a step (forward; backward or its recompute): copied, reused, or
        # (the head, the forward's last unit) kept from its forward to its backward. A block's span is its
        # weights' bytes: they are 64-byte multiples here, so there is no padding.
        assert stats.last_step_h2d_bytes + reused == 2 * frozen - head
        # Backward -> forward: the first two blocks are still in the two slots; forward -> backward: the
        # last block is kept for the backward anyway, and the one before it is still in its slot.
        assert reused >= 2 * block_span, (step, reused, block_span)
    manager.remove()


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("options", GRANULARITIES, ids=["block", "leaf"])
def test_training_with_reuse_equals_resident_training(checkpointing: str | None, options: OffloadOptions) -> None:
    expected = train(make_stack("adapter", checkpointing), steps=4)
    got = train(make_stack("adapter", checkpointing), steps=4, offload={"options": options})
    assert got[0] == expected[0]
    for name, value in expected[1].items():
        assert torch.equal(got[1][name], value), name
    assert got[2] is not None and got[2].stats().reused_bytes > 0  # the reuse did happen


def _write_in_place(model: nn.Module, manager: OffloadTrainingManager | None) -> None:
    """Between steps, write the frozen base of the first block (reused at the next forward) in place, the
    ways a user does: through the parameter under no_grad, and through load_state_dict."""
    with torch.no_grad():
        model.blocks[0].fc1.base.weight.mul_(1.5)
    state = {"blocks.0.fc2.base.bias": model.blocks[0].fc2.base.bias.detach().clone() + 0.25}
    model.load_state_dict(state, strict=False)


@pytest.mark.parametrize("options", GRANULARITIES, ids=["block", "leaf"])
def test_a_weight_written_in_place_between_steps_is_copied_again(options: OffloadOptions) -> None:
    expected = train(make_stack("adapter", "non_reentrant"), steps=4, between_steps=_write_in_place)
    got = train(
        make_stack("adapter", "non_reentrant"), steps=4, offload={"options": options}, between_steps=_write_in_place
    )
    assert got[0] == expected[0]
    for name, value in expected[1].items():
        assert torch.equal(got[1][name], value), name


class NormBlock(nn.Module):
    """A block whose BatchNorm updates its running statistics in every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.fc(x))


def test_buffers_a_forward_updates_are_not_reused_stale() -> None:
    """Running statistics change on the device and are copied back; the slot's bytes are then old."""

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(*(NormBlock() for _ in range(4)), nn.Linear(WIDTH, WIDTH))
        for block in model[:4]:
            block.fc.requires_grad_(False)
        return model

    def run(offload: bool) -> dict[str, torch.Tensor]:
        model = make()
        manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(prefetch=1)) if offload else None
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(16, WIDTH, generator=generator)
            F.mse_loss(model(x), x).backward()
            if manager is not None:
                manager.after_backward()
            optimizer.step()
            optimizer.zero_grad()
        if manager is not None:
            manager.remove()
        return {k: v.clone() for k, v in model.state_dict().items()}

    expected, got = run(False), run(True)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("granularity", ["block", "leaf"])
def test_nf4_units_still_in_their_slot_skip_the_copy_and_the_dequantization(granularity: str) -> None:
    """A unit's NF4 payloads and their dequantized rooms are reused together; the training stays bitwise."""
    from tests.offload.quant.test_quantized import WIDTH as Q_WIDTH
    from tests.offload.quant.test_quantized import make
    from tests.offload.quant.test_quantized import train as train_quantized

    expected = train_quantized(make("nf4", "non_reentrant"), None)
    model = make("nf4", "non_reentrant")
    options = OffloadOptions(granularity=granularity, prefetch=1)
    got = train_quantized(model, {"options": options})
    assert got[0] == expected[0]
    for name, value in expected[1].items():
        assert torch.equal(got[1][name], value), name

    model = make("nf4", "non_reentrant")
    manager = OffloadTrainingManager(model, "cpu", options=options)
    dequantizers = [o for o in manager._offloaders.values() if hasattr(o, "dequantizations")]
    for _ in range(3):
        model(torch.randn(2, 8, Q_WIDTH, dtype=torch.bfloat16)).float().sum().backward()
        manager.after_backward()
    done = sum(o.dequantizations for o in dequantizers)
    # Three blocks, each needed twice a step: without reuse 3 * 2 * 3 visits per weight. Step 1 records (no
    # reuse); the other two each reuse at least the blocks at the turnarounds.
    assert manager.stats().reused_bytes > 0
    assert done < len(dequantizers) * 2 * 3
    manager.remove()


def test_reuse_ring_slots_false_copies_every_visit() -> None:
    model = _deep_stack("non_reentrant")
    options = OffloadOptions(granularity="block", prefetch=1, reuse_ring_slots=False)
    manager = OffloadTrainingManager(model, "cpu", options=options)
    for _ in range(3):
        x = torch.randn(8, WIDTH)
        F.mse_loss(model(x), x).backward()
        manager.after_backward()
    assert manager.stats().reused_bytes == 0
    manager.remove()
