"""Learning-rate schedules and optimizer choice."""

from __future__ import annotations

import pytest
import torch

from jobs.spec.job import TrainingSpec
from jobs.train.optim import build_optimizer, lr_factor


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


def test_the_fused_kernel_is_asked_for_on_the_cpu_and_on_cuda() -> None:
    """Optimizer offload with a budget leaves the first parameters on the GPU: the CPU's share must still get
    the fused kernel (torch's default for a mixed list is the for-loop one); all on CUDA, torch's default is the
    foreach kernel, 7.9 ms a step on an H100 where the fused one takes under one (jobs/train/optim.py)."""
    from jobs.train.optim import fused_for

    cpu = torch.nn.Parameter(torch.zeros(2))
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))  # stands in for a device the rule checks by type

    class OnCuda:  # a CUDA parameter's two attributes the rule reads, without a GPU
        device = torch.device("cuda", 0)

        def is_floating_point(self) -> bool:
            return True

    assert fused_for([cpu]) is True
    assert fused_for([OnCuda(), cpu]) is True  # type: ignore[list-item]
    assert fused_for([OnCuda()]) is True  # type: ignore[list-item]
    assert fused_for([meta, cpu]) is None
    assert fused_for([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)), cpu]) is True
