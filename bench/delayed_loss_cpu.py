"""The delayed update's loss against exact training on the CPU: the seed's toy model scaled to 512 wide.

Run:  python bench/delayed_loss_cpu.py   (about a minute on two cores; prints the loss at step 100)
"""

from __future__ import annotations

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


if __name__ == "__main__":
    for lr in (1e-4, 1e-5):
        exact, delayed = losses(False, lr), losses(True, lr)
        gap = abs(delayed[-1] - exact[-1]) / exact[-1] * 100
        print(f"lr {lr:g}: step 100 exact {exact[-1]:.4f}, delayed_update {delayed[-1]:.4f} ({gap:.2f}% apart)")
