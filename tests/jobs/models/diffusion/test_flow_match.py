"""Flow matching: the families' schedules, the timestep window, the weighting, the objective, the sampler."""

from __future__ import annotations

import math

import pytest
import torch

from jobs.models.diffusion.flow_match import (
    TrainingTimesteps,
    bell_weights,
    euler_sample,
    flow_matching_loss,
    noisy_latents,
    sigmas,
)


def test_wan_schedule_is_the_shift_5_formula() -> None:
    base = torch.linspace(1.0, 0.0, 11, dtype=torch.float64)[:-1]
    assert torch.equal(sigmas("wan", 10), 5 * base / (1 + 4 * base))


def test_qwen_image_schedule_is_the_exponential_shift_stretched_to_0_02() -> None:
    schedule = sigmas("qwen_image", 1000)
    assert schedule[0] == pytest.approx(1.0)
    assert schedule[-1] == pytest.approx(0.02)
    assert bool((schedule[1:] < schedule[:-1]).all())
    # Before the stretch, the midpoint sigma 0.5 maps to e^0.8 / (e^0.8 + 1).
    assert sigmas("qwen_image", 1000)[500] != sigmas("wan", 1000)[500]
    assert math.exp(0.8) / (math.exp(0.8) + 1) == pytest.approx(0.6900, abs=1e-4)


def test_unknown_family_has_no_schedule() -> None:
    with pytest.raises(ValueError, match="no flow-matching schedule for family 'flux'"):
        sigmas("flux", 10)


def test_bell_weights_average_one_and_peak_mid_schedule() -> None:
    timesteps = sigmas("wan", 1000) * 1000
    weights = bell_weights(timesteps)
    assert weights.mean().item() == pytest.approx(1.0)
    assert weights.min().item() == pytest.approx(0.0)
    assert weights[torch.argmin((timesteps - 500).abs())] == weights.max()


def test_timestep_range_keeps_sigmas_inside_its_part_of_the_schedule() -> None:
    schedule = sigmas("wan", 1000)
    window = TrainingTimesteps("wan", (0.9, 1.0), "none")
    sigma, weight = window.draw(torch.Generator().manual_seed(0), batch=512)
    assert float(sigma.max()) <= float(schedule[900]) + 1e-6  # the low-noise tenth only
    assert torch.equal(weight, torch.ones(512))
    full = TrainingTimesteps("wan", (0.0, 1.0), "bell").draw(torch.Generator().manual_seed(0), batch=512)[0]
    assert float(full.max()) > float(schedule[900])


def test_loss_is_zero_for_the_true_velocity_and_weighted_per_sample() -> None:
    x0, noise = torch.randn(2, 4, 1, 8, 8), torch.randn(2, 4, 1, 8, 8)
    assert flow_matching_loss(noise - x0, x0, noise, torch.ones(2)).item() == 0.0
    wrong = noise - x0 + 1.0
    assert flow_matching_loss(wrong, x0, noise, torch.tensor([1.0, 0.0])).item() == pytest.approx(0.5)


def test_noisy_latents_follow_the_straight_path() -> None:
    x0, noise = torch.randn(2, 3), torch.randn(2, 3)
    out = noisy_latents(x0, noise, torch.tensor([0.0, 1.0]))
    assert torch.equal(out[0], x0[0]) and torch.equal(out[1], noise[1])


def test_euler_with_the_exact_velocity_lands_on_the_data() -> None:
    x0, noise = torch.randn(1, 4, 1, 4, 4, dtype=torch.float64), torch.randn(1, 4, 1, 4, 4, dtype=torch.float64)
    # The Qwen schedule starts at sigma 1: the start is pure noise and v = noise - x0 is constant.
    out = euler_sample(lambda x, s: noise - x0, noise.clone(), "qwen_image", 4)
    assert torch.allclose(out, x0)
