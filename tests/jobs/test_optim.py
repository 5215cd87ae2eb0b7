"""Learning-rate schedules and optimizer choice."""

from __future__ import annotations

import pytest
import torch

from jobs.optim import build_optimizer, lr_factor
from jobs.spec import TrainingSpec


def test_warmup_then_schedules() -> None:
    assert [lr_factor(s, kind="constant", warmup_steps=4, total_steps=10) for s in range(5)] == [0.25, 0.5, 0.75, 1, 1]
    assert lr_factor(4, kind="linear", warmup_steps=4, total_steps=10) == 1.0
    assert lr_factor(10, kind="linear", warmup_steps=4, total_steps=10) == 0.0
    assert lr_factor(7, kind="cosine", warmup_steps=4, total_steps=10) == pytest.approx(0.5)


def test_optimizers() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(build_optimizer(params, TrainingSpec(steps=1)), torch.optim.AdamW)
    assert isinstance(build_optimizer(params, TrainingSpec(steps=1, optimizer="sgd")), torch.optim.SGD)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([], TrainingSpec(steps=1))
