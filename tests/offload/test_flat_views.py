"""Block units reuse the views they carve out of a ring slot.

A block's span copied into the device ring lands in the same slot every time, so the members' views over it
are made once (in the first step) and handed out again after that. On a launch-bound step (a DiT block with
peft's LoRA) that per-copy Python work was host time the GPU waited for. Training stays bitwise the same
(test_equivalence.py, test_budget_spread.py and the diffusion offload tests cover the results).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import offload.flat
from offload import OffloadOptions, OffloadTrainingManager
from tests.offload.models import WIDTH, Stack


def _frozen_stack(checkpointing: str | None) -> Stack:
    torch.manual_seed(0)
    model = Stack(depth=6, checkpointing=checkpointing)
    model.requires_grad_(False)
    model.blocks[0].norm.requires_grad_(True)  # something to train
    return model


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_ring_views_are_made_in_the_first_step_only(
    monkeypatch: pytest.MonkeyPatch, checkpointing: str | None, prefetch: int
) -> None:
    model = _frozen_stack(checkpointing)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", prefetch=prefetch))
    made: list[int] = []
    view = offload.flat._view
    monkeypatch.setattr(offload.flat, "_view", lambda *a: made.append(1) or view(*a))
    for step in range(3):
        before = len(made)
        x = torch.randn(4, WIDTH)
        F.mse_loss(model(x), x).backward()
        manager.after_backward()
        assert manager.stats().ring_overflows == 0
        if step > 0:
            assert len(made) == before, f"step {step} made {len(made) - before} views"
    assert made
    manager.remove()
