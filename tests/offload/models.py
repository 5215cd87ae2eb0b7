"""Tiny seeded models and a training loop shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload import OffloadTrainingManager

WIDTH = 32


class Adapter(nn.Module):
    """A LoRA-style low-rank adapter beside a frozen linear layer."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    """Blocks with optional per-block gradient checkpointing (``"reentrant"`` or ``"non_reentrant"``)."""

    def __init__(self, depth: int = 3, width: int = WIDTH, checkpointing: str | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "reentrant" and not x.requires_grad:
            # Reentrant checkpointing only back-propagates when an input needs grad (frozen-base case).
            x = x.detach().requires_grad_()
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = block(x)
        return self.head(x)


def make_stack(method: str, checkpointing: str | None, seed: int = 0) -> Stack:
    """``method``: ``"full"`` trains everything, ``"adapter"`` freezes the base and adds adapters."""
    torch.manual_seed(seed)
    model = Stack(checkpointing=checkpointing)
    if method == "adapter":
        model.requires_grad_(False)
        for block in model.blocks:
            block.fc1 = Adapter(block.fc1)
            block.fc2 = Adapter(block.fc2)
    return model


def train(
    model: nn.Module,
    *,
    steps: int = 5,
    offload: dict | None = None,
    device: str = "cpu",
    micro_batches: int = 1,
    seed: int = 1,
    between_steps: Callable[[nn.Module, OffloadTrainingManager | None], None] | None = None,
    attach: dict | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], OffloadTrainingManager | None]:
    """Train with AdamW; ``offload`` holds the manager's keyword arguments (None = no manager), ``attach``
    those of ``manager.attach_optimizer`` (None = the optimizer steps after ``after_backward``).

    Returns the losses, the final state dict (on the CPU) and the manager (already removed).
    """
    manager = None
    if offload is not None:
        manager = OffloadTrainingManager(model, device, **offload)
    else:
        model.to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if manager is not None and attach is not None:
        manager.attach_optimizer(optimizer, **attach)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randn(8, WIDTH, generator=generator).to(device)
            loss = F.mse_loss(model(x), x + 1) / micro_batches
            loss.backward()
            losses.append(loss.item())
        if manager is not None:
            manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        if between_steps is not None:
            between_steps(model, manager)
    if manager is not None:
        manager.remove()
    state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
    return losses, state, manager
