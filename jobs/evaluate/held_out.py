"""Evaluation on held-out data: a token-weighted eval loss and its perplexity, and early stopping.

A preference job (``training.objective: dpo | orpo``) evaluates its pairs instead (jobs/evaluate/pairs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from jobs.models import LossFn

IGNORE = -100


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the mean loss over every labelled token of the batches seen, and exp of it.

    A preference job's loss is the mean over pairs instead; it has no perplexity, and ``preference`` holds the
    reward metrics of ``jobs.objectives.preference.METRICS`` (means over the pairs) and ``pairs`` their number.
    """

    loss: float
    perplexity: float | None
    tokens: int
    batches: int
    pairs: int | None = None
    preference: dict[str, float] | None = None


def evaluate(
    model: nn.Module, loss_fn: LossFn, source: Any, *, max_batches: int | None, device: torch.device, accelerator: Any
) -> EvalResult:
    """The eval loss of ``model`` over the first ``max_batches`` batches of ``source`` (all by default).

    Each batch's mean loss is weighted by its labelled tokens, so the result does not depend on how
    tokens fall into batches. Dropout is off while it runs; the model is left in training mode.
    """
    batches = source.batches_per_epoch if max_batches is None else min(max_batches, source.batches_per_epoch)
    total = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.long)
    model.eval()
    try:
        with torch.no_grad():
            for index in range(batches):
                batch = {name: tensor.to(device) for name, tensor in source.in_order(index).items()}
                counted = (batch["labels"][:, 1:] != IGNORE).sum()  # the causal shift: the first label never counts
                with accelerator.autocast():
                    loss = loss_fn(model, batch)
                total += loss.double() * counted
                tokens += counted
    finally:
        model.train()
    count = int(tokens.item())  # CPU-GPU sync point: once per evaluation
    mean = float(total.item()) / max(count, 1)
    return EvalResult(loss=mean, perplexity=math.exp(min(mean, 700.0)), tokens=count, batches=batches)


class EvalHistory:
    """The best eval loss so far, and how many evaluations in a row have not improved on it."""

    def __init__(self, min_delta: float = 0.0) -> None:
        self.min_delta = min_delta
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.since_best = 0
        self.last_step: int | None = None
        self.last_loss: float | None = None

    def record(self, step: int, result: EvalResult) -> bool:
        """Note an evaluation; True when it is the best so far."""
        self.last_step, self.last_loss = step, result.loss
        if self.best_loss is None or result.loss < self.best_loss - self.min_delta:
            self.best_loss, self.best_step, self.since_best = result.loss, step, 0
            return True
        self.since_best += 1
        return False

    def state_dict(self) -> dict[str, Any]:
        """Plain values, saved in ``training_state.pt`` so early stopping resumes where it was."""
        return {key: getattr(self, key) for key in _STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in _STATE:
            setattr(self, key, state[key])


_STATE = ("best_loss", "best_step", "since_best", "last_step", "last_loss")
