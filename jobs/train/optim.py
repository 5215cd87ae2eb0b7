"""Optimizer and learning-rate schedule from the ``training`` section."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from jobs.spec.job import TrainingSpec


def build_optimizer(params: list[torch.nn.Parameter], spec: TrainingSpec) -> torch.optim.Optimizer:
    """AdamW, Adam or SGD (momentum 0.9) over ``params``."""
    if not params:
        raise ValueError("the model has no trainable parameters; check lora.target_modules")
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.learning_rate, momentum=0.9, weight_decay=spec.weight_decay)
    optimizer_class = torch.optim.AdamW if spec.optimizer == "adamw" else torch.optim.Adam
    return optimizer_class(params, lr=spec.learning_rate, weight_decay=spec.weight_decay, fused=fused_for(params))


def fused_for(params: list[torch.nn.Parameter]) -> bool | None:
    """Adam(W)'s ``fused``: True when every parameter is floating point on the CPU or a CUDA device, else torch's
    own choice (None).

    On CUDA torch's default is the foreach kernel: on an H100 (bench/speed_bench.py's profile tables, LoRA r16 on a
    3B, 28 layers) that was 7.9 ms a step against the fused kernel the plain transformers + peft baseline asks
    for, most of a millisecond; the fused kernel computes the same update (torch tests them against each other).

    On the CPU the fused kernel is several times faster than the default for-loop/foreach one (the figures are in
    shared/design/offload-engine.md). With a memory budget, optimizer
    offload keeps the first parameters on the GPU (offload/plan.py); torch's default for such a mixed list is
    the for-loop kernel on both devices, so the fused one is asked for there too (it steps each device apart).
    """
    fusable = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return True if fusable else None


def lr_factor(step: int, *, kind: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Warmup rises linearly to 1 over ``warmup_steps`` (never 0, so no step is wasted); then ``constant``
    stays at 1, ``linear`` falls to 0 at ``total_steps`` and ``cosine`` follows half a cosine to 0.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, spec: TrainingSpec, total_steps: int) -> LambdaLR:
    """The schedule of ``training.scheduler`` over ``total_steps`` optimizer steps."""
    kind, warmup = spec.scheduler.kind, spec.scheduler.warmup_steps
    return LambdaLR(optimizer, lambda step: lr_factor(step, kind=kind, warmup_steps=warmup, total_steps=total_steps))
