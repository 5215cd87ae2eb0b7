"""``--profile`` for the benches' own training loops: two more steps under ``training.profile``'s profiler."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from jobs.reporting.step_profile import StepProfiler, peak_flops, training_flops


def profile_steps(
    step: Callable[[], object], model: nn.Module, tokens: int, seq_len: int, device: torch.device, dtype: torch.dtype
) -> str:
    """Run ``step`` twice under torch.profiler; the report a job's ``training.profile`` gives (the shares of the step,
    TFLOP/s and MFU, jobs/reporting/step_profile.py), for ``tokens`` a step in sequences of ``seq_len``."""
    profiler = StepProfiler(
        device=device,
        first=1,
        last=2,
        flops=lambda t: training_flops(model, t, seq_len),
        peak=peak_flops(device, dtype),
    )
    report = None
    for index in (1, 2):
        profiler.before_step(index)
        step()
        report = profiler.after_step(index, tokens)
    assert report is not None  # the second call ends the profile
    return report.message()
