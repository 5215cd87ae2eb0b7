"""Evaluation of a preference job (``training.objective: dpo | orpo``) on its held-out pairs: the mean loss and
the reward metrics the training steps report, each weighted by the pairs of its batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jobs.evaluate.held_out import IGNORE, EvalResult
from jobs.objectives.preference import METRICS, PreferenceLoss


def evaluate_pairs(
    model: nn.Module,
    loss_fn: PreferenceLoss,
    source: Any,
    *,
    max_batches: int | None,
    device: torch.device,
    accelerator: Any,
) -> EvalResult:
    """The eval loss and reward metrics of ``model`` over the first ``max_batches`` batches of pairs of ``source``
    (a ``PreferenceBatches``; all of them by default).

    Each batch's mean is weighted by its pairs, so the result does not depend on how pairs fall into batches.
    The training step's metrics kept in ``loss_fn`` are left as they were, and so is its reference-row mask.
    Dropout is off while it runs; the model is left in training mode.

    Example:
        >>> result = evaluate_pairs(model, loss_fn, data.eval, max_batches=None, device=device, accelerator=acc)
        >>> result.loss, result.preference["rewards_accuracies"]
    """
    batches = source.batches_per_epoch if max_batches is None else min(max_batches, source.batches_per_epoch)
    total = torch.zeros((), device=device, dtype=torch.float64)
    sums = torch.zeros(len(METRICS), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.long)
    pairs = 0
    model.eval()
    try:
        with torch.no_grad(), loss_fn.kept_apart():
            for index in range(batches):
                batch = {name: tensor.to(device) for name, tensor in source.in_order(index).items()}
                count = batch["labels"].shape[0] // 2  # chosen rows, then rejected rows
                with accelerator.autocast():
                    loss = loss_fn(model, batch)
                batch_means, _ = loss_fn.take_sums()  # this batch's: one call since the last take
                total += loss.double() * count
                sums += torch.stack([batch_means[name] for name in METRICS]).double() * count
                tokens += (batch["labels"][:, 1:] != IGNORE).sum()  # the causal shift: the first label never counts
                pairs += count
    finally:
        model.train()
    means = torch.cat([total.view(1), sums]) / max(pairs, 1)
    figures = torch.cat([means, tokens.double().view(1)]).tolist()  # CPU-GPU sync point: once per evaluation
    preference = dict(zip(METRICS, figures[1:-1], strict=True))
    return EvalResult(
        loss=figures[0], perplexity=None, tokens=int(figures[-1]), batches=batches, pairs=pairs, preference=preference
    )
