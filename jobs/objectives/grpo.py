"""Group Relative Policy Optimization (``training.objective: grpo``): the loss, the advantages and the rollout.

The formulas are TRL's ``GRPOTrainer`` (trl 1.16, trl/trainer/grpo_trainer.py, ``_compute_loss`` and
``_generate_and_score_completions``), with ``num_iterations = 1`` and token-level importance sampling, its
defaults:

- advantages: each reward minus its group's mean, over the group's std (unbiased) plus 1e-4. A group whose
  rewards are all equal gets advantage 0 (no signal, no division by zero) and is counted in
  ``frac_reward_zero_std``.
- per token: ``-min(r A, clip(r, 1 - eps, 1 + eps) A) + beta * kl`` with ``r = exp(logp - old_logp)`` and the k3
  estimator ``kl = exp(ref - logp) - (ref - logp) - 1``.
- ``loss_type``: ``grpo`` averages each completion's tokens, then the completions; ``dr_grpo`` sums the tokens
  over ``completions * max_new_tokens``; ``dapo`` sums them over the step's completion tokens.

One generation per optimizer step, one gradient update per generation: the "old" log-probs are the policy's own,
detached (what TRL does when ``num_iterations == 1``), so the ratio is 1 and no extra forward computes them.

The reference for the KL (``beta > 0``) is the base with the LoRA adapters off (peft's ``disable_adapter()``, as
DPO's reference is), computed without a graph at rollout time; a full fine-tune has no such base and is refused
with ``beta > 0`` (jobs/spec/rules_llm.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

METRICS = ("reward_mean", "reward_std", "frac_reward_zero_std", "kl", "completion_length", "clip_ratio")

Grade = Callable[[list[str], list[dict[str, Any]]], list[float]]  # completions, their rows -> rewards


def group_advantages(rewards: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion: its reward minus its group's mean, over the group's std + 1e-4 (TRL's ``scale_rewards:
    group``); and per completion whether its group's std is zero (all rewards equal: advantage exactly 0).

    ``rewards`` holds the groups one after another, ``num_generations`` completions each."""
    if num_generations < 2:
        raise ValueError("training.grpo.num_generations must be at least 2: one completion has no group to compare")
    grouped = rewards.float().view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    std = grouped.std(dim=1).repeat_interleave(num_generations)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    advantages = (rewards.float() - mean) / (std + 1e-4)
    return torch.where(zero_std, torch.zeros_like(advantages), advantages), zero_std


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    epsilon: float,
    epsilon_high: float | None,
    loss_type: str,
    max_completion_length: int,
    num_items: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's GRPO loss of per-token log-probs (``[rows, tokens]``, ``mask`` 1 on completion tokens), and its
    detached metrics (``kl``, ``clip_ratio``).

    ``num_items``: dapo's normalizer, the completion tokens of the whole generation batch (default: ``mask``'s)."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    coef_1 = torch.exp(logps - old)
    low, high = epsilon, epsilon if epsilon_high is None else epsilon_high
    coef_2 = torch.clamp(coef_1, 1 - low, 1 + high)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    metrics: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("training.grpo.beta > 0 needs the reference log-probs")
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * per_token_kl
        metrics["kl"] = ((per_token_kl * mask).sum() / mask.sum().clamp(min=1.0)).detach()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    elif loss_type == "dapo":
        normalizer = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=logps.dtype)
        loss = (per_token * mask).sum() / normalizer.clamp(min=1.0)
    else:
        raise ValueError(f"training.grpo.loss_type must be grpo, dr_grpo or dapo; got {loss_type!r}")
    clipped = ((coef_1 < 1 - low) & (adv < 0)) | ((coef_1 > 1 + high) & (adv > 0))
    metrics["clip_ratio"] = ((clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0)).detach()
    return loss, metrics


def token_logps(model: nn.Module, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[rows, length - 1]``: the log-prob of each next token, from logits over ``temperature`` (as TRL scores
    them, so the ratio and KL are of the distribution that sampled)."""
    output = model(input_ids=input_ids)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    logits = logits[:, :-1].float() / temperature
    picked = torch.gather(logits, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sample_group(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stops: frozenset[int],
    pad_id: int,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_generations`` sampled continuations of one prompt, decoded together as one batch.

    Returns the completion ids ``[G, T]`` (``pad_id`` after a stop) and their mask (1 up to and including the
    stop token, as TRL's). No KV cache: each step runs the window (as jobs/evaluate/text_samples.py does, for
    every model kind alike); the G rows share each forward, so an offloaded model streams its weights once per
    decode step for the group."""
    rows = num_generations
    ids = torch.tensor([list(prompt_ids)] * rows, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    new, keep = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            output = model(input_ids=ids)
            logits = (output if isinstance(output, torch.Tensor) else output.logits)[:, -1].float() / temperature
            token = _sample_top_p(logits, top_p, generator)
            token = torch.where(done, torch.full_like(token, pad_id), token)
            keep.append(~done)
            new.append(token)
            ids = torch.cat([ids, token.unsqueeze(1)], dim=1)
            if stops:
                done = done | torch.isin(token, torch.tensor(sorted(stops), device=device))
            if bool(done.all()):  # CPU-GPU sync point, once per decode step
                break
    return torch.stack(new, dim=1), torch.stack(keep, dim=1).long()


def _sample_top_p(logits: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:  # nucleus: the smallest set of tokens whose probability reaches top_p
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@dataclass
class Rollout:
    """One step's generations: the training batch and what was sampled and graded."""

    batch: dict[str, torch.Tensor]
    completions: list[str]
    rewards: torch.Tensor


class GRPOLoss:
    """The loss function of a grpo job (a ``LossFn``): ``rollout`` samples and grades a step's groups into a batch,
    ``__call__`` is the loss of that batch, ``take_metrics`` the step's reward, KL, length and clip figures.

    Args:
        grpo: The ``training.grpo`` section.
        grade: Rewards for completions and their rows (jobs/objectives/graders.py).
        decode: Token ids to text.

    Example:
        >>> loss_fn = GRPOLoss(spec.training.grpo, grade, tokenizer.decode)
        >>> batch = loss_fn.rollout(model, prompts, rows, stops=stops, pad_id=0, device=device).batch
        >>> train_step(model, loss_fn, [batch], ...); loss_fn.take_metrics()["reward_mean"]
    """

    def __init__(
        self,
        grpo: Any,
        grade: Grade,
        decode: Callable[[list[int]], str],
        *,
        stops: frozenset[int] = frozenset(),
        pad_id: int = 0,
    ) -> None:
        self.grpo, self.grade, self.decode = grpo, grade, decode
        self.stops, self.pad_id = stops, pad_id  # the ids a completion ends at (eos, end of turn); its padding
        self._metrics: dict[str, list[torch.Tensor]] = {}
        self._zero_std_logged = False

    def rollout(
        self,
        model: nn.Module,
        prompts: Sequence[Sequence[int]],
        rows: Sequence[dict[str, Any]],
        *,
        stops: frozenset[int],
        pad_id: int,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        """Sample ``num_generations`` completions of each prompt, grade them, and build the batch: the prompt
        and completion ids right-padded (``input_ids``), ``completion_mask`` over them, ``advantages`` and, with
        ``beta > 0``, the reference's per-token log-probs."""
        grpo = self.grpo
        was_training = model.training
        model.eval()
        sequences, masks, completions, graded_rows = [], [], [], []
        try:
            for prompt, row in zip(prompts, rows, strict=True):
                ids, keep = sample_group(
                    model,
                    prompt,
                    num_generations=grpo.num_generations,
                    max_new_tokens=grpo.max_new_tokens,
                    temperature=grpo.temperature,
                    top_p=grpo.top_p,
                    stops=stops,
                    pad_id=pad_id,
                    device=device,
                    generator=generator,
                )
                for completion, kept in zip(ids.tolist(), keep.tolist(), strict=True):
                    tokens = [t for t, k in zip(completion, kept, strict=True) if k]
                    text_ids = [t for t in tokens if t not in stops]
                    completions.append(self.decode(text_ids))
                    graded_rows.append(row)
                    sequences.append(list(prompt) + tokens)
                    masks.append([0] * len(prompt) + [1] * len(tokens))
        finally:
            model.train(was_training)
        rewards = torch.tensor(self.grade(completions, graded_rows), dtype=torch.float32)
        advantages, zero_std = group_advantages(rewards, grpo.num_generations)
        if bool(zero_std.any()) and not self._zero_std_logged:
            log.info("grpo: a group's rewards are all equal; its advantages are 0 (no update from it)")
            self._zero_std_logged = True
        width = max(len(s) for s in sequences)
        input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences], device=device)
        completion_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], device=device)
        batch = {"input_ids": input_ids, "completion_mask": completion_mask, "advantages": advantages.to(device)}
        if grpo.beta != 0.0:
            batch["ref_logps"] = self._reference_logps(model, input_ids)
        lengths = completion_mask.sum(-1).float()
        self._add("reward_mean", rewards.mean())
        self._add("reward_std", rewards.std() if rewards.numel() > 1 else torch.zeros(()))
        self._add("frac_reward_zero_std", zero_std.float().mean())
        self._add("completion_length", lengths.mean().cpu())
        return Rollout(batch=batch, completions=completions, rewards=rewards)

    def step_batches(
        self,
        model: nn.Module,
        micro_batches: Sequence[Sequence[tuple[list[int], dict[str, Any]]]],
        *,
        device: torch.device,
    ) -> list[dict[str, torch.Tensor]]:
        """One optimizer step's batches: each micro-batch of (prompt ids, row) sampled and graded. dapo's
        normalizer is the step's completion tokens, split over the micro-batches (train_step averages them)."""
        batches = []
        for prompts in micro_batches:
            ids, rows = [p for p, _ in prompts], [r for _, r in prompts]
            batches.append(self.rollout(model, ids, rows, stops=self.stops, pad_id=self.pad_id, device=device).batch)
        tokens = torch.stack([batch["completion_mask"].sum() for batch in batches]).sum().float()
        for batch in batches:
            batch["num_items"] = tokens / len(batches)
        return batches

    def _reference_logps(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        disable = getattr(model, "disable_adapter", None)
        if disable is None:
            raise ValueError(
                "training.grpo.beta > 0 takes the reference from the base with the LoRA adapters off; "
                "set lora, or beta: 0 for a full fine-tune"
            )
        with torch.no_grad(), disable() if callable(disable) else nullcontext():
            return token_logps(model, input_ids, self.grpo.temperature)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The GRPO loss of a rollout's batch."""
        grpo = self.grpo
        logps = token_logps(model, batch["input_ids"], grpo.temperature)
        mask = batch["completion_mask"][:, 1:]
        loss, metrics = grpo_loss(
            logps,
            None,
            batch.get("ref_logps"),
            batch["advantages"],
            mask,
            beta=grpo.beta,
            epsilon=grpo.epsilon,
            epsilon_high=grpo.epsilon_high,
            loss_type=grpo.loss_type,
            max_completion_length=grpo.max_new_tokens,
            num_items=batch.get("num_items"),
        )
        for name, value in metrics.items():
            self._add(name, value)
        return loss

    def _add(self, name: str, value: torch.Tensor) -> None:
        self._metrics.setdefault(name, []).append(value.detach().float().cpu())

    def take_metrics(self) -> dict[str, float]:
        """The step's metrics (each averaged over its micro-batches) since the last call."""
        metrics, self._metrics = self._metrics, {}
        return {name: float(torch.stack(values).mean()) for name, values in metrics.items()}
