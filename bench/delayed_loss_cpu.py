"""The delayed update's loss against exact training on the CPU: the seed's toy model scaled to 512 wide, and
beside it the same one-step-stale schedule written as a plain loop without the engine (``stale_by_hand``).

Run:  python bench/delayed_loss_cpu.py   (about a minute on two cores; prints the loss at step 100 and the
largest difference between the engine's delayed curve and the plain loop's)
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.offload_bench import ToyModel
from offload import OffloadTrainingManager


def losses(delayed: bool, lr: float, steps: int = 100) -> list[float]:
    torch.manual_seed(0)
    model = ToyModel(width=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer, delayed_update=delayed, warmup_steps=2)
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(128, 512, generator=generator)
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    manager.remove()
    return out


def stale_by_hand(lr: float, steps: int = 100, warmup: int = 2) -> list[float]:
    """Exact for ``warmup`` steps, then each step's forward and backward run on the weights from before the
    previous step's update (a copy published after each update), while the updates go on in order."""
    torch.manual_seed(0)
    model = ToyModel(width=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1)
    published = copy.deepcopy(model)
    out = []
    for step in range(steps):
        x = torch.randn(128, 512, generator=generator)
        reader = published if step > warmup else model
        for param in reader.parameters():
            param.grad = None
        loss = F.mse_loss(reader(x), x + 1)
        loss.backward()
        out.append(loss.item())
        grads = [p.grad.clone() for p in reader.parameters()]
        published.load_state_dict(model.state_dict())  # what the next step reads: before this update
        for param, grad in zip(model.parameters(), grads, strict=True):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad()
    return out


if __name__ == "__main__":
    for lr in (1e-4, 1e-5):
        exact, delayed, by_hand = losses(False, lr), losses(True, lr), stale_by_hand(lr)
        gap = abs(delayed[-1] - exact[-1]) / exact[-1] * 100
        apart = max(abs(a - b) for a, b in zip(delayed, by_hand, strict=True))
        print(
            f"lr {lr:g}: step 100 exact {exact[-1]:.4f}, delayed_update {delayed[-1]:.4f} ({gap:.2f}% apart); "
            f"largest difference from the plain stale loop over 100 steps: {apart:.1e}"
        )
