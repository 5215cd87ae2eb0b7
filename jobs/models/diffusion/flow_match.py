"""Flow matching (rectified flow) as Qwen-Image and Wan are trained, after DiffSynth-Studio's flow_match.py.

Noise follows the straight path ``x_t = (1 - sigma) * x_0 + sigma * noise``; the DiT predicts the velocity
and the target is ``noise - x_0``; the loss is the MSE in float32 times a per-timestep weight.

Training draws a timestep index uniformly from the family's 1000-step schedule, restricted to
``training.timestep_range`` (fractions of the schedule, DiffSynth's ``min/max_timestep_boundary``). The
schedules differ by family:

- ``wan``: ``sigma' = s * sigma / (1 + (s - 1) * sigma)`` with shift s = 5.
- ``qwen_image``: the exponential shift ``sigma' = e^mu / (e^mu + 1/sigma - 1)`` with mu = 0.8, then a
  terminal stretch so the last sigma is 0.02.

Loss weighting (``training.timestep_weighting``): ``bell`` is DiffSynth's default, a Gaussian bump over
the timestep, ``w(t) = exp(-2 ((t - 500) / 1000)^2)``, shifted to be 0 at its minimum and scaled to mean 1
over the schedule, so mid-range timesteps count most. ``none`` weighs every timestep 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

TRAIN_STEPS = 1000
WAN_SHIFT = 5.0
QWEN_MU = 0.8
QWEN_SHIFT_TERMINAL = 0.02


def sigmas(family: str, steps: int) -> torch.Tensor:
    """The family's descending sigma schedule of ``steps`` values in (0, 1] (float64, CPU)."""
    base = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1]
    if family == "wan":
        return WAN_SHIFT * base / (1 + (WAN_SHIFT - 1) * base)
    if family == "qwen_image":
        shifted = math.exp(QWEN_MU) / (math.exp(QWEN_MU) + (1 / base - 1))
        one_minus = 1 - shifted
        return 1 - one_minus / (one_minus[-1] / (1 - QWEN_SHIFT_TERMINAL))
    raise ValueError(f"no flow-matching schedule for family {family!r}")


def bell_weights(timesteps: torch.Tensor) -> torch.Tensor:
    """DiffSynth's training weights over a 1000-step schedule: a Gaussian bump of mean 1."""
    bump = torch.exp(-2 * ((timesteps - TRAIN_STEPS / 2) / TRAIN_STEPS) ** 2)
    shifted = bump - bump.min()
    return shifted * (TRAIN_STEPS / shifted.sum())


class TrainingTimesteps:
    """Draws (sigma, weight) pairs for training from one family's schedule.

    Example:
        >>> timesteps = TrainingTimesteps("wan", (0.0, 1.0), "bell")
        >>> sigma, weight = timesteps.draw(torch.Generator().manual_seed(0), batch=2)
    """

    def __init__(self, family: str, timestep_range: tuple[float, float], weighting: str) -> None:
        self.family = family
        self.sigmas = sigmas(family, TRAIN_STEPS)
        self.weights = bell_weights(self.sigmas * TRAIN_STEPS) if weighting == "bell" else torch.ones(TRAIN_STEPS)
        # DiffSynth's boundaries: indices [min * N, max * N) of the descending schedule (index 0 = most noise).
        low, high = timestep_range
        self.first, self.last = int(low * TRAIN_STEPS), max(int(high * TRAIN_STEPS), int(low * TRAIN_STEPS) + 1)

    def draw(self, generator: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` sigmas and their loss weights (float32, CPU), from ``generator``."""
        index = torch.randint(self.first, self.last, (batch,), generator=generator)
        return self.sigmas[index].float(), self.weights[index].float()


def noisy_latents(latents: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``(1 - sigma) * x_0 + sigma * noise`` with one sigma per sample."""
    s = sigma.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return (1 - s) * latents + s * noise


def flow_matching_loss(
    prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Weighted MSE between the predicted velocity and ``noise - x_0``, in float32."""
    target = noise.float() - latents.float()
    per_sample = (prediction.float() - target).pow(2).flatten(1).mean(dim=1)
    return (per_sample * weight.float()).mean()


def euler_sample(
    predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], latents: torch.Tensor, family: str, steps: int
) -> torch.Tensor:
    """Denoise ``latents`` (pure noise) in ``steps`` Euler steps on the family's schedule.

    ``predict(x, sigma)`` returns the velocity; each step moves ``x += v * (sigma_next - sigma)``, the
    scheduler step of DiffSynth's FlowMatchScheduler and diffusers' FlowMatchEulerDiscreteScheduler.
    """
    schedule = [*sigmas(family, steps).tolist(), 0.0]
    x = latents
    for sigma, after in itertools.pairwise(schedule):
        sigma_batch = torch.full((x.shape[0],), sigma, device=x.device, dtype=torch.float32)
        x = x + predict(x, sigma_batch).to(x.dtype) * (after - sigma)
    return x
