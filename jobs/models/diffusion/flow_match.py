"""Flow matching (rectified flow) as Qwen-Image, Wan and Flux are trained, after DiffSynth-Studio's flow_match.py.

Noise follows the straight path ``x_t = (1 - sigma) * x_0 + sigma * noise``; the DiT predicts the velocity
and the target is ``noise - x_0``; the loss is the MSE in float32 times a per-timestep weight.

Training draws a timestep index uniformly from the family's 1000-step schedule, restricted to
``training.timestep_range`` (fractions of the schedule, DiffSynth's ``min/max_timestep_boundary``). The
schedules differ by family:

- ``wan``: ``sigma' = s * sigma / (1 + (s - 1) * sigma)`` with shift s = 5.
- ``qwen_image``: the exponential shift ``sigma' = e^mu / (e^mu + 1/sigma - 1)`` with mu = 0.8, then a
  terminal stretch so the last sigma is 0.02.
- ``flux1`` / ``flux2``: the same exponential shift with mu from the image's token count, the line through
  0.5 at 256 tokens and 1.15 at 4096 (FluxPipeline's ``calculate_shift``, kohya's ``flux_shift``): 1.15 for a
  1024 x 1024 image. Flux.2's pipeline samples with ``compute_empirical_mu(tokens, steps)``, whose 200-step
  line is that same line; training uses it, and samples use the pipeline's own mu for their step count.

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


FLUX_BASE_TOKENS, FLUX_MAX_TOKENS = 256, 4096
FLUX_BASE_SHIFT, FLUX_MAX_SHIFT = 0.5, 1.15
FLUX2_LINE_STEPS = 200  # compute_empirical_mu's step count whose line is calculate_shift's


def flux_mu(family: str, image_tokens: int, steps: int | None = None) -> float:
    """The exponential shift's mu for an image of ``image_tokens`` tokens: training's (``steps`` None) or the
    pipeline's for ``steps`` sampling steps (FluxPipeline ``calculate_shift``, Flux2Pipeline
    ``compute_empirical_mu``)."""
    if family == "flux2" and steps is not None:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_tokens, steps)
    slope = (FLUX_MAX_SHIFT - FLUX_BASE_SHIFT) / (FLUX_MAX_TOKENS - FLUX_BASE_TOKENS)
    return image_tokens * slope + FLUX_BASE_SHIFT - slope * FLUX_BASE_TOKENS


def sigmas(family: str, steps: int, image_tokens: int | None = None, *, sampling: bool = False) -> torch.Tensor:
    """The family's descending sigma schedule of ``steps`` values in (0, 1] (float64, CPU); Flux's depends on the
    image's token count, and Flux.2's sampling mu on ``steps`` too (``sampling``)."""
    base = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1]
    if family in ("flux1", "flux2"):
        if image_tokens is None:
            raise ValueError(f"the {family} schedule depends on the image's token count; none given")
        mu = flux_mu(family, image_tokens, steps if sampling else None)
        return math.exp(mu) / (math.exp(mu) + (1 / base - 1))
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

    DYNAMIC = ("flux1", "flux2")  # schedules that depend on the image's token count

    def __init__(self, family: str, timestep_range: tuple[float, float], weighting: str) -> None:
        self.family, self.weighting = family, weighting
        self._schedules: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        if family not in self.DYNAMIC:
            self.sigmas, self.weights = self.schedule(None)
        # DiffSynth's boundaries: indices [min * N, max * N) of the descending schedule (index 0 = most noise).
        low, high = timestep_range
        self.first, self.last = int(low * TRAIN_STEPS), max(int(high * TRAIN_STEPS), int(low * TRAIN_STEPS) + 1)

    def schedule(self, image_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmas, weights) of the schedule for images of ``image_tokens`` tokens (ignored where fixed)."""
        key = image_tokens if self.family in self.DYNAMIC else None
        if key not in self._schedules:
            values = sigmas(self.family, TRAIN_STEPS, key)
            weights = bell_weights(values * TRAIN_STEPS) if self.weighting == "bell" else torch.ones(TRAIN_STEPS)
            self._schedules[key] = (values, weights)
        return self._schedules[key]

    def draw(
        self, generator: torch.Generator, batch: int, image_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` sigmas and their loss weights (float32, CPU), from ``generator``; Flux's schedule is the one
        of the batch's image size (``image_tokens``: a batch holds one size)."""
        values, weights = self.schedule(image_tokens)
        index = torch.randint(self.first, self.last, (batch,), generator=generator)
        return values[index].float(), weights[index].float()


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
    predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    family: str,
    steps: int,
    image_tokens: int | None = None,
) -> torch.Tensor:
    """Denoise ``latents`` (pure noise) in ``steps`` Euler steps on the family's schedule (Flux: the pipeline's
    for an image of ``image_tokens`` tokens).

    ``predict(x, sigma)`` returns the velocity; each step moves ``x += v * (sigma_next - sigma)``, the
    scheduler step of DiffSynth's FlowMatchScheduler and diffusers' FlowMatchEulerDiscreteScheduler.
    """
    schedule = [*sigmas(family, steps, image_tokens, sampling=True).tolist(), 0.0]
    x = latents
    for sigma, after in itertools.pairwise(schedule):
        sigma_batch = torch.full((x.shape[0],), sigma, device=x.device, dtype=torch.float32)
        x = x + predict(x, sigma_batch).to(x.dtype) * (after - sigma)
    return x
