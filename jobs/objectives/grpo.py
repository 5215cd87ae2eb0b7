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

A step's completions, of every prompt of every micro-batch, are sampled in one batched decode loop with a KV cache
(jobs/objectives/generation.py): under model offload the weights stream once per decode step for all of them, or,
where the units that stream fit the device beside the cache (``hold_weights``: the engine's
``hold_for_inference``), once for the whole loop.

One generation per optimizer step, one gradient update per generation: the "old" log-probs are the policy's own,
detached (what TRL does when ``num_iterations == 1``), so the ratio is 1 and no extra forward computes them.

The reference for the KL (``beta > 0``) is the base with the LoRA adapters off (peft's ``disable_adapter()``, as
DPO's reference is), computed without a graph at rollout time; a full fine-tune has no such base and is refused
with ``beta > 0`` (jobs/spec/rules_llm.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from jobs.objectives.generation import generate
from jobs.objectives.generation_memory import decode_memory_bytes

log = logging.getLogger(__name__)

METRICS = ("reward_mean", "reward_std", "frac_reward_zero_std", "kl", "completion_length", "clip_ratio")

Grade = Callable[[list[str], list[dict[str, Any]]], list[float]]  # completions, their rows -> rewards
# Given the decode loop's own bytes (KV cache, logits), keeps what fits of the streamed weights on the device for
# the loop; what it yields describes itself (``describe()``) and counts the units it kept (``units``).
HoldWeights = Callable[[int], AbstractContextManager[Any]]


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


@dataclass
class Rollout:
    """One step's generations: the training batch and what was sampled and graded.

    Attributes:
        batch: the training batch (the first micro-batch where the rollout was split).
        completions: the decoded completions, each prompt's ``num_generations`` one after another.
        rewards: one per completion.
        batches: the batch cut into micro-batches of whole groups.
        rows: the prompts' rows, one per prompt.
    """

    batch: dict[str, torch.Tensor]
    completions: list[str]
    rewards: torch.Tensor
    batches: list[dict[str, torch.Tensor]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


class GRPOLoss:
    """The loss function of a grpo job (a ``LossFn``): ``rollout`` samples and grades a step's groups into a batch,
    ``__call__`` is the loss of that batch, ``take_metrics`` the step's reward, KL, length and clip figures.

    Args:
        grpo: The ``training.grpo`` section.
        grade: Rewards for completions and their rows (jobs/objectives/graders.py).
        decode: Token ids to text.
        hold_weights: Under model offload, the engine's ``hold_for_inference``: the streamed units that fit stay
            on the device for the whole decode loop instead of crossing the link once per decode step.
        compile_decode: ``training.compile``: the decode steps run compiled over a static KV cache
            (jobs/objectives/compiled_decode.py) when every unit is on the device for the loop (resident, kept
            by the budget or held); a unit that still streams per decode step keeps the eager loop.

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
        hold_weights: HoldWeights | None = None,
        compile_decode: bool = False,
    ) -> None:
        self.grpo, self.grade, self.decode = grpo, grade, decode
        self.hold_weights = hold_weights
        self.compile_decode = compile_decode  # training.compile: the decode steps compiled where every unit is held
        self._held_line = ""  # the last hold's description, logged when it changes
        self.stops, self.pad_id = stops, pad_id  # the ids a completion ends at (eos, end of turn); its padding
        self._metrics: dict[str, list[torch.Tensor]] = {}
        self._totals: dict[str, float] = {}
        self._zero_std_logged = False
        self._streaming_logged = False

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
        split: int = 1,
        autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> Rollout:
        """Sample ``num_generations`` completions of each prompt, all of them decoded as one batch, grade them,
        and build the training batch: the prompt and completion ids right-padded (``input_ids``),
        ``completion_mask`` over them, ``advantages`` and, with ``beta > 0``, the reference's per-token
        log-probs. ``split`` > 1 cuts the batch into that many micro-batches of whole groups
        (``Rollout.batches``). ``autocast``: the training step's mixed precision (``accelerator.autocast``), so
        that the completions are sampled from the distribution the loss scores."""
        grpo = self.grpo
        group = grpo.num_generations
        expanded = [list(p) for p in prompts for _ in range(group)]  # a prompt's group: consecutive rows
        held: AbstractContextManager[Any] = nullcontext()
        if self.hold_weights is not None:
            width = max(len(p) for p in expanded)
            held = self.hold_weights(decode_memory_bytes(model, len(expanded), width, grpo.max_new_tokens))
        with autocast(), held as hold:
            streams = hold is not None and hold.units < hold.streamed  # a unit crosses the link per decode step
            if self.compile_decode and streams and not self._streaming_logged:
                log.info("training.compile: generation decodes eagerly: %s", hold.describe())
                self._streaming_logged = True
            generated = generate(
                model,
                expanded,
                max_new_tokens=grpo.max_new_tokens,
                temperature=grpo.temperature,
                top_p=grpo.top_p,
                stops=stops,
                pad_id=pad_id,
                device=device,
                generator=generator,
                compile_decode=self.compile_decode and not streams,
            )
        if hold is not None:
            self._note_hold(hold)
        sequences, masks, completions = [], [], []
        for prompt, completion, kept in zip(expanded, generated.ids.tolist(), generated.mask.tolist(), strict=True):
            tokens = [t for t, k in zip(completion, kept, strict=True) if k]
            completions.append(self.decode([t for t in tokens if t not in stops]))
            sequences.append(prompt + tokens)
            masks.append([0] * len(prompt) + [1] * len(tokens))
        graded_rows = [row for row in rows for _ in range(group)]
        rewards = torch.tensor(self.grade(completions, graded_rows), dtype=torch.float32)
        advantages, zero_std = group_advantages(rewards, group)
        if bool(zero_std.any()) and not self._zero_std_logged:
            log.info("grpo: a group's rewards are all equal; its advantages are 0 (no update from it)")
            self._zero_std_logged = True
        per_batch = -(-len(prompts) // max(1, split)) * group  # whole groups in each micro-batch
        batches = []
        with autocast():  # the reference's log-probs (beta > 0), in the loss's precision
            for i in range(0, len(sequences), per_batch):
                part = slice(i, i + per_batch)
                batches.append(self._batch(model, sequences[part], masks[part], advantages[part], pad_id, device))
        lengths = generated.mask.sum(-1).float()
        self._add("reward_mean", rewards.mean())
        self._add("reward_std", rewards.std() if rewards.numel() > 1 else torch.zeros(()))
        self._add("frac_reward_zero_std", zero_std.float().mean())
        self._add("completion_length", lengths.mean().cpu())
        self._count("generated_tokens", generated.tokens)
        self._count("generation_s", generated.seconds)
        self._count("training_tokens", sum(len(s) for s in sequences))
        return Rollout(batch=batches[0], completions=completions, rewards=rewards, batches=batches, rows=list(rows))

    def _note_hold(self, hold: Any) -> None:
        """Count the units the decode loop kept on the device, and log the decision when it changes."""
        self._count("generation_units_kept", hold.units)
        line = hold.describe()
        if line != self._held_line:
            log.info("grpo: %s", line)
            self._held_line = line

    def _batch(
        self,
        model: nn.Module,
        sequences: list[list[int]],
        masks: list[list[int]],
        advantages: torch.Tensor,
        pad_id: int,
        device: torch.device,
    ) -> dict[str, torch.Tensor]:
        width = max(len(s) for s in sequences)
        input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences], device=device)
        completion_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], device=device)
        batch = {"input_ids": input_ids, "completion_mask": completion_mask, "advantages": advantages.to(device)}
        if self.grpo.beta != 0.0:
            batch["ref_logps"] = self._reference_logps(model, input_ids)
        return batch

    def step_batches(
        self,
        model: nn.Module,
        micro_batches: Sequence[Sequence[tuple[list[int], dict[str, Any]]]],
        *,
        device: torch.device,
        autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> tuple[list[dict[str, torch.Tensor]], Rollout]:
        """One optimizer step's batches and what was sampled for them: the prompts of every micro-batch sampled
        together (one decode loop for the whole step), graded, then cut into the micro-batches again. dapo's
        normalizer is the step's completion tokens, split over the micro-batches (train_step averages them)."""
        pairs = [pair for prompts in micro_batches for pair in prompts]
        rollout = self.rollout(
            model,
            [p for p, _ in pairs],
            [r for _, r in pairs],
            stops=self.stops,
            pad_id=self.pad_id,
            device=device,
            split=len(micro_batches),
            autocast=autocast,
        )
        batches = rollout.batches
        tokens = torch.stack([batch["completion_mask"].sum() for batch in batches]).sum().float()
        for batch in batches:
            batch["num_items"] = tokens / len(batches)
        return batches, rollout

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

    def _count(self, name: str, value: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + float(value)

    def take_metrics(self) -> dict[str, float]:
        """The step's metrics since the last call: each figure averaged over its rollouts and micro-batches,
        and the sums ``generated_tokens``, ``generation_s`` (the decode loops' wall time), ``training_tokens``
        (prompt and completion tokens the loss reads) and, under model offload, ``generation_units_kept``."""
        metrics, self._metrics = self._metrics, {}
        totals, self._totals = self._totals, {}
        return {**{name: float(torch.stack(values).mean()) for name, values in metrics.items()}, **totals}
