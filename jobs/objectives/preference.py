"""Preference objectives (``training.objective: dpo | orpo``) over batches of chosen rows then rejected rows.

DPO's reference model is the base without the LoRA adapters. It rides the policy's forward: the batch is
doubled (policy rows, then reference rows) and a forward hook on every adapter's ``lora_B`` multiplies the
adapter's output by zero on the reference rows, so those rows compute exactly what the base computes (what
peft's ``disable_adapter()`` gives). Each weight is therefore copied to the device once for both models: a DPO
step streams the bytes of an SFT step. The hooks stay in place through the backward, so an activation
checkpoint's recompute masks the same rows. The reference log-probs are detached, so no gradient reaches those
rows: checkpointed layers keep and recompute the policy rows alone (``only_first_rows_need_gradient``), the
chunked head runs the reference rows without a graph, and the reference costs one forward of its rows, not a
forward, a recompute and a backward.

A full fine-tune has no base to switch back to: its reference log-probs are the initial model's, computed once
before training (jobs/train/reference_logps.py), and each batch carries its rows' (``reference_logps``).

The formulas are TRL's (``DPOTrainer``, ``ORPOTrainer``): log-probs summed over completion tokens for DPO,
averaged for ORPO's odds ratio.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jobs.checkpoints.weights import is_peft_model
from jobs.data.formats.examples import IGNORE
from jobs.recompute.chunked_loss import chunked_completion_logps
from jobs.recompute.flags import batch_rows, only_first_rows_need_gradient

METRICS = (
    "rewards_chosen",
    "rewards_rejected",
    "rewards_accuracies",
    "rewards_margins",
    "logps_chosen",
    "logps_rejected",
)


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-prob of the labelled (completion) tokens, and how many there are."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]  # token t predicts token t + 1
    mask = labels != IGNORE
    picked = torch.gather(logits, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = picked - torch.logsumexp(logits, dim=-1)
    return (per_token * mask).sum(-1), mask.sum(-1)


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    counts: tuple[torch.Tensor, torch.Tensor],
    spec: Any,
) -> torch.Tensor:
    """Per-pair DPO loss of ``spec.loss_type`` (TRL's formulas; ``label_smoothing`` is cDPO's, sigmoid only)."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if spec.loss_type == "ipo":  # per completion token, as TRL normalizes it
        delta = chosen_ratio / counts[0].clamp(min=1) - rejected_ratio / counts[1].clamp(min=1)
        return (delta - 1 / (2 * spec.beta)) ** 2
    delta = chosen_ratio - rejected_ratio
    if spec.loss_type == "hinge":
        return torch.relu(1 - spec.beta * delta)
    smoothing = spec.label_smoothing
    return -F.logsigmoid(spec.beta * delta) * (1 - smoothing) - F.logsigmoid(-spec.beta * delta) * smoothing


def odds_ratio_losses(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor) -> torch.Tensor:
    """ORPO's ``-log sigmoid(log odds(chosen) - log odds(rejected))`` of mean per-token log-probs."""
    chosen_mean, rejected_mean = chosen_mean.float(), rejected_mean.float()
    log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
    return -F.logsigmoid(log_odds)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    # log(1 - exp(x)) for x < 0, branching at -ln 2 to avoid cancellation (TRL's log1mexp).
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class PreferenceLoss:
    """The loss function of a dpo or orpo job (a ``LossFn``), which also keeps the step's reward metrics.

    Args:
        training: The ``training`` section (``objective``, ``dpo``, ``orpo``).
        model: The model the job trains. DPO masks its LoRA adapters on the reference rows; a model without
            adapters (a full fine-tune) reads the reference log-probs from the batch (``reference_logps``).

    Example:
        >>> loss_fn = PreferenceLoss(spec.training, model)
        >>> loss = loss_fn(model, batch)  # batch: chosen rows, then rejected rows
        >>> loss_fn.take_metrics()["rewards_accuracies"]
    """

    def __init__(self, training: Any, model: nn.Module) -> None:
        self.objective, self.dpo, self.orpo = training.objective, training.dpo, training.orpo
        self._mask: torch.Tensor | None = None  # 1 on policy rows, 0 on reference rows; kept through backward
        self._handles = _mask_adapters(model, self) if self.objective == "dpo" and is_peft_model(model) else []
        # No adapters, no base to switch back to: the initial model's log-probs come with each batch.
        self.cached_reference = self.objective == "dpo" and not self._handles
        self._sums: dict[str, torch.Tensor] = {}
        self._batches = 0

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean loss over the batch's pairs."""
        labels = batch["labels"]
        pairs = labels.shape[0] // 2
        if self.objective == "dpo":
            policy, reference, counts = self._policy_and_reference(model, batch)
            chosen, rejected = policy[:pairs], policy[pairs:]
            ref_chosen, ref_rejected = reference[:pairs], reference[pairs:]
            losses = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, (counts[:pairs], counts[pairs:]), self.dpo)
            rewards = (
                self.dpo.beta * (chosen - ref_chosen).detach(),
                self.dpo.beta * (rejected - ref_rejected).detach(),
            )
            loss = losses.mean()
        else:
            logps, counts = sequence_logps(model, batch, labels)
            chosen, rejected = logps[:pairs], logps[pairs:]
            mean = logps / counts.clamp(min=1)
            nll = -chosen.sum() / counts[:pairs].sum().clamp(min=1)  # the chosen completions' token mean
            loss = nll + self.orpo.beta * odds_ratio_losses(mean[:pairs], mean[pairs:]).mean()
            rewards = (self.orpo.beta * mean[:pairs].detach(), self.orpo.beta * mean[pairs:].detach())
        self._record(rewards, chosen.detach(), rejected.detach())
        return loss

    def _policy_and_reference(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: the policy's summed completion log-probs, the reference's (detached), the completion tokens."""
        labels = batch["labels"]
        if self.cached_reference:
            if "reference_logps" not in batch:
                raise ValueError(
                    "dpo without lora needs each batch's reference_logps, which the reference pass before training "
                    "adds to the data (jobs/train/reference_logps.py)"
                )
            logps, counts = sequence_logps(model, batch, labels)
            return logps, batch["reference_logps"].to(logps.dtype), counts
        rows = labels.shape[0]
        self._mask = torch.cat([labels.new_ones(rows), labels.new_zeros(rows)])
        doubled = {name: torch.cat([tensor, tensor]) for name, tensor in batch.items() if name != "labels"}
        with only_first_rows_need_gradient(rows):  # the reference rows' log-probs are detached below
            logps, counts = sequence_logps(model, doubled, torch.cat([labels, labels]))
        return logps[:rows], logps[rows:].detach(), counts[:rows]

    def _record(self, rewards: tuple[torch.Tensor, torch.Tensor], chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        values = {
            "rewards_chosen": rewards[0].mean(),
            "rewards_rejected": rewards[1].mean(),
            "rewards_accuracies": (rewards[0] > rewards[1]).float().mean(),
            "rewards_margins": (rewards[0] - rewards[1]).mean(),
            "logps_chosen": chosen.mean(),
            "logps_rejected": rejected.mean(),
        }
        for name, value in values.items():
            self._sums[name] = self._sums.get(name, torch.zeros_like(value)) + value.float()
        self._batches += 1

    def take_metrics(self) -> dict[str, float]:
        """The metrics averaged over the micro-batches since the last call; call it after the step's backward."""
        self._mask = None  # the step is over: later forwards (samples) run the policy alone
        sums, batches = self.take_sums()
        if not batches:
            return {}
        stacked = torch.stack([sums[name] for name in METRICS]) / batches
        return dict(zip(METRICS, stacked.tolist(), strict=True))  # CPU-GPU sync point: once per step

    def take_sums(self) -> tuple[dict[str, torch.Tensor], int]:
        """The metrics summed over the micro-batches since the last take (device tensors, no sync), and how
        many micro-batches that was."""
        sums, batches = self._sums, self._batches
        self._sums, self._batches = {}, 0
        return sums, batches

    @contextmanager
    def kept_apart(self) -> Iterator[None]:
        """Forwards inside (an evaluation) record their metrics apart from the training step's: on leaving, the
        step's sums, micro-batch count and reference-row mask are as they were on entering."""
        saved = self._sums, self._batches, self._mask
        self._sums, self._batches = {}, 0
        try:
            yield
        finally:
            self._sums, self._batches, self._mask = saved

    def remove(self) -> None:
        """Take the adapter hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def mask_rows(self, output: torch.Tensor) -> torch.Tensor | None:
        """An adapter's output with the reference rows zeroed (None: leave it as is). A call over part of the
        batch (a recompute of the policy rows, the head over the reference rows) reads its rows' part of the mask;
        a part of policy rows alone is left as is, with no multiply."""
        mask = self._mask
        if mask is None:
            return None
        if output.shape[0] != mask.shape[0]:
            rows = batch_rows(output.shape[0])
            if rows.stop <= mask.shape[0] // 2:  # the policy rows come first
                return None
            mask = mask[rows]
            if output.shape[0] != mask.shape[0]:
                return None
        return output * mask.to(output.dtype).view(-1, *([1] * (output.dim() - 1)))


def sequence_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``completion_logps`` of the model's forward over ``batch``: chunk by chunk where the float32 logits
    would be large (jobs/recompute/chunked_loss.py), so they never exist for the whole batch at once."""
    chunked = chunked_completion_logps(model, batch, labels)
    return chunked if chunked is not None else completion_logps(forward_logits(model, batch), labels)


def forward_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits for a batch's ``input_ids`` (with its position ids and attention mask, where given)."""
    extra = {name: batch[name] for name in ("position_ids", "attention_mask") if name in batch}
    output = model(input_ids=batch["input_ids"], **extra)
    return output if isinstance(output, torch.Tensor) else output.logits


def _mask_adapters(model: nn.Module, loss: PreferenceLoss) -> list[Any]:
    """A forward hook on every LoRA ``lora_A``; refuses adapters whose output it cannot mask.

    ``lora_A``'s output is rank wide, and ``lora_B`` (no bias) maps its zero rows to zero rows: the same adapter
    output as masking ``lora_B``'s, out_features wide, for a multiply a few hundred times smaller."""
    from peft.tuners.lora import LoraLayer

    handles = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        with_bias = any(getattr(b, "bias", None) is not None for b in module.lora_B.values())
        if len(getattr(module, "lora_embedding_B", {})) or getattr(module, "lora_variant", {}) or with_bias:
            raise ValueError(
                f"dpo: the adapter on {name} is not a plain LoRA linear; remove it from lora.target_modules"
            )
        for adapter in module.lora_A.values():
            handles.append(adapter.register_forward_hook(lambda _m, _i, out: loss.mask_rows(out)))
    return handles
