"""GRPO's loss against TRL's own ``GRPOTrainer._compute_loss`` (the oracle), the advantages, and learning on CPU."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from jobs.objectives.grpo import GRPOLoss, group_advantages, grpo_loss
from tests.jobs.llm_helpers import tiny_llama

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")


class _Accelerator:
    num_processes = 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    gather_for_metrics = gather

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def _trl_loss(logps: torch.Tensor, inputs: dict[str, Any], *, loss_type: str, beta: float, eps: float) -> torch.Tensor:
    """TRL's ``_compute_loss`` itself, its model forward replaced by the given per-token log-probs."""
    tokens = logps.shape[1]
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=tokens,
        accelerator=_Accelerator(),
        _metrics={"train": defaultdict(list)},
        _entropy_bonus_enabled=False,
    )
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradients_equal_trls(loss_type: str, beta: float) -> None:
    torch.manual_seed(0)
    rows, tokens = 6, 5
    base = torch.randn(rows, tokens, dtype=torch.float64) - 2
    old = base + 0.3 * torch.randn(rows, tokens, dtype=torch.float64)  # ratios away from 1: the clip bites
    ref = base + 0.2 * torch.randn(rows, tokens, dtype=torch.float64)
    mask = (torch.rand(rows, tokens) > 0.3).long()
    mask[:, 0] = 1
    advantages = torch.randn(rows, dtype=torch.float64)
    inputs = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(rows, tokens, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum().double(),
    }
    theirs_logps = base.clone().requires_grad_()
    theirs = _trl_loss(theirs_logps, inputs, loss_type=loss_type, beta=beta, eps=0.2)
    theirs.backward()
    ours_logps = base.clone().requires_grad_()
    ours, metrics = grpo_loss(
        ours_logps,
        old,
        ref,
        advantages,
        mask,
        beta=beta,
        epsilon=0.2,
        epsilon_high=None,
        loss_type=loss_type,
        max_completion_length=tokens,
    )
    ours.backward()
    # float64 throughout: the same operations in the same order, so equal to 1e-12.
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, rtol=1e-12, atol=1e-12)
    assert 0 < float(metrics["clip_ratio"]) < 1


def test_advantages_are_trls_and_equal_rewards_give_zero() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    advantages, zero_std = group_advantages(rewards, 4)
    first = rewards[:4]
    torch.testing.assert_close(advantages[:4], (first - first.mean()) / (first.std() + 1e-4))
    assert advantages[4:].tolist() == [0.0] * 4 and zero_std.tolist() == [False] * 4 + [True] * 4
    assert torch.isfinite(advantages).all()


def test_one_generation_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="training.grpo.num_generations"):
        group_advantages(torch.tensor([1.0, 0.0]), 1)


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def grpo_section(**overrides: Any) -> Any:
    from jobs.spec.llm import GRPOSpec

    grader = {"type": "string_check", "reference": "{{item.answer}}", "operation": "like"}
    return GRPOSpec.model_validate(
        {"num_generations": 8, "max_new_tokens": 4, "temperature": 1.0, "grader": grader, **overrides}
    )


def train_rewards(
    model: torch.nn.Module, grpo: Any, steps: int, seed: int = 0, lr: float = 2e-2, compile_decode: bool = False
) -> list[dict[str, float]]:
    """The metrics of each step of GRPO on "say f somewhere in 4 tokens", through the runner's train_step."""
    from accelerate import Accelerator

    from jobs.objectives.graders import Graders
    from jobs.train.runner import train_step

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    loss_fn = GRPOLoss(grpo, Graders(grpo.grader), letters, compile_decode=compile_decode)
    generator = torch.Generator().manual_seed(seed)
    prompts = [[1, 2, 3], [4, 2], [7, 8, 9, 1], [3, 3]]
    rows = [{"prompt": letters(p), "answer": "f"} for p in prompts]
    rewards = []
    for _ in range(steps):
        rollout = loss_fn.rollout(
            model, prompts, rows, stops=frozenset({0}), pad_id=0, device=torch.device("cpu"), generator=generator
        )
        train_step(
            model,
            loss_fn,
            [rollout.batch],
            optimizer=optimizer,
            scheduler=scheduler,
            accelerator=accelerator,
            manager=None,
            max_grad_norm=1.0,
            device=torch.device("cpu"),
        )
        metrics = loss_fn.take_metrics()
        assert {"reward_mean", "reward_std", "completion_length", "clip_ratio"} <= set(metrics)
        rewards.append(metrics)
    return rewards


def test_grpo_raises_the_mean_reward_of_a_tiny_model_deterministically() -> None:
    rewards = [m["reward_mean"] for m in train_rewards(tiny_llama(16), grpo_section(), steps=12)]
    again = [m["reward_mean"] for m in train_rewards(tiny_llama(16), grpo_section(), steps=12)]
    assert rewards == again  # the seed decides every sample and every update
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert start < 0.5 and end > 0.9, rewards


def test_lora_grpo_with_kl_to_the_base_learns_and_reports_kl() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(16), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"])
    )
    metrics = train_rewards(model, grpo_section(beta=0.04, loss_type="grpo"), steps=12, lr=5e-2)
    rewards = [m["reward_mean"] for m in metrics]
    assert sum(rewards[:3]) / 3 < 0.5 and sum(rewards[-3:]) / 3 > 0.9, rewards
    assert metrics[0]["kl"] == 0.0 < metrics[-1]["kl"]  # B starts at zero: the policy starts as the base
