"""Activation offload: checkpointed block inputs kept on the host from forward to their recompute.

Bitwise the gradients of training without it (and without the engine), each saved input sent once a step and
brought back by the prefetch its successor's unpack started, host buffers reused across steps, and the
arena planned from the sizes a job gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload import OffloadOptions, OffloadTrainingManager, plan_memory
from offload.activations import SavedInput
from tests.offload.models import Adapter, Block

WIDTH, TOKENS, DEPTH = 32, 256, 4
INPUT_BYTES = 2 * TOKENS * WIDTH * 4  # one block's input: batch 2 x 256 tokens x 32 float32


class CheckpointedStack(nn.Module):
    """Blocks checkpointed through a replaceable function, as transformers and diffusers layers are."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, WIDTH)
        self._gradient_checkpointing_func: Callable[..., Any] = functools.partial(checkpoint, use_reentrant=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()  # reentrant checkpointing needs an input that requires grad
        for block in self.blocks:
            x = self._gradient_checkpointing_func(block, x)
        return self.head(x)


def make_model() -> CheckpointedStack:
    torch.manual_seed(0)
    model = CheckpointedStack()
    model.requires_grad_(False)
    for block in model.blocks:
        block.fc1 = Adapter(block.fc1)  # type: ignore[arg-type]  # a Block's Linear
        block.fc2 = Adapter(block.fc2)  # type: ignore[arg-type]
    return model


def gradients(
    options: OffloadOptions | None, steps: int = 3, device: str = "cpu"
) -> tuple[list[dict[str, torch.Tensor]], object]:
    """Each step's adapter gradients (AdamW steps between them, on the CPU), and the manager (or None)."""
    model = make_model()
    manager = OffloadTrainingManager(model, device, options=options) if options is not None else None
    if manager is None:
        model.to(device)
    if manager is not None and manager.activations is not None:
        model._gradient_checkpointing_func = manager.activations.wrap(model._gradient_checkpointing_func)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        x = torch.randn(2, TOKENS, WIDTH, generator=generator).to(device)
        F.mse_loss(model(x), x + 1).backward()
        if manager is not None:
            manager.after_backward()
        grads.append({n: p.grad.cpu().clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return grads, manager


@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_activation_offload_gives_bitwise_the_gradients_of_training_without_it(granularity: str) -> None:
    plain, _ = gradients(None)
    streamed, _ = gradients(OffloadOptions(granularity=granularity))
    offloaded, manager = gradients(OffloadOptions(granularity=granularity, offload_activations=True))
    assert len(plain[0]) == 4 * DEPTH  # every adapter got a gradient
    for a, b, c in zip(plain, streamed, offloaded, strict=True):
        assert a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[n], c[n]) and torch.equal(b[n], c[n]) for n in a)
    stats = manager.stats()  # type: ignore[attr-defined]
    assert stats.activation_offloaded_bytes == 3 * DEPTH * INPUT_BYTES  # each block's input, once a step
    assert stats.activation_host_bytes == DEPTH * INPUT_BYTES  # one step's inputs at once, reused after


def test_backward_finds_each_input_already_coming_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpacking a block's input starts the copy of the input saved before it: every input but the first
    one backward needs (the last block's) is on its way when its recompute asks for it."""
    prefetched = []
    unpack = SavedInput.unpack

    def recording(self: SavedInput) -> torch.Tensor:
        prefetched.append(self.on_device is not None)
        return unpack(self)

    monkeypatch.setattr(SavedInput, "unpack", recording)
    gradients(OffloadOptions(offload_activations=True), steps=2)
    assert prefetched == 2 * ([False] + [True] * (DEPTH - 1))


def test_the_plan_sizes_the_activation_arena_and_the_engine_keeps_to_it() -> None:
    sizes = (INPUT_BYTES,) * DEPTH
    options = OffloadOptions(offload_activations=True, activation_host_bytes=sizes)
    plan = plan_memory(make_model(), options=options)
    assert plan.activation_requested_bytes == DEPTH * INPUT_BYTES <= plan.activation_reserved_bytes
    assert plan_memory(make_model(), options=OffloadOptions(activation_host_bytes=sizes)).activation_reserved_bytes == 0
    _, manager = gradients(options)
    arena = manager.activations.arena  # type: ignore[attr-defined]
    assert arena.reserved_bytes == plan.activation_reserved_bytes  # after three steps: nothing allocated since
    assert manager.stats().pinned_reserved_bytes == manager.arena.reserved_bytes + arena.reserved_bytes  # type: ignore[attr-defined]


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [1, 0], ids=["copy-streams", "compute-stream"])
def test_on_cuda_the_copies_and_their_events_give_the_same_gradients(prefetch: int) -> None:
    """The device->host copies on their stream, the prefetches on the copy stream (or, prefetch 0, every copy
    on the compute stream) and the reuse of host buffers across steps: the same gradients as without."""
    plain, _ = gradients(None, device="cuda")
    offloaded, manager = gradients(OffloadOptions(prefetch=prefetch, offload_activations=True), device="cuda")
    for a, b in zip(plain, offloaded, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    stats = manager.stats()  # type: ignore[attr-defined]
    assert stats.activation_offloaded_bytes == 3 * DEPTH * INPUT_BYTES
    assert stats.activation_host_bytes == DEPTH * INPUT_BYTES


def test_a_forward_without_grad_saves_nothing_to_the_host() -> None:
    model = make_model()
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(offload_activations=True))
    assert manager.activations is not None
    model._gradient_checkpointing_func = manager.activations.wrap(model._gradient_checkpointing_func)
    with torch.no_grad():
        model(torch.randn(2, TOKENS, WIDTH))
    manager.after_forward()
    assert manager.stats().activation_offloaded_bytes == 0
    assert manager.activations.wrap(model._gradient_checkpointing_func) is model._gradient_checkpointing_func
