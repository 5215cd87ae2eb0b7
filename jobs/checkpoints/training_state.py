"""Training state saved with each checkpoint: optimizer, scheduler, RNG, step and data position."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

TRAINING_STATE = "training_state.pt"


def capture_rng() -> dict[str, Any]:
    """Every random generator a training step draws from (dropout, peft init, Python's random)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(
    directory: Path,
    *,
    step: int,
    data_position: int,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> None:
    """Write ``training_state.pt`` (tensors and plain containers only, so it loads with weights_only).
    ``optimizer_state``: the state to write when ``optimizer.state_dict()`` is not all of it (the ranks' parts of
    a split optimizer, gathered)."""
    torch.save(
        {
            "step": step,
            "data_position": data_position,
            "optimizer": optimizer_state if optimizer_state is not None else optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": capture_rng(),
            "extra": extra or {},  # the runner's own state, e.g. the eval history early stopping needs
        },
        directory / TRAINING_STATE,
    )


def load_training_state(directory: Path, *, mmap: bool = False) -> dict[str, Any]:
    """Read ``training_state.pt`` on the CPU. ``weights_only`` refuses pickled code from a tampered file.
    ``mmap``: the tensors map the file (read as they are used) instead of being read into memory."""
    return torch.load(directory / TRAINING_STATE, map_location="cpu", weights_only=True, mmap=mmap)
