"""Whether a job's loss makes its logits all at once or chunk by chunk, decided from the fit check's estimate.

The chunked loss (jobs/recompute/chunked_loss.py) never holds the whole sequence's logits, at the price of the head's
matmul again in backward. A job needs that only where the whole logits would not fit: the estimate's peak with
them (``MemoryEstimate.whole_logits_peak_bytes``: the family's ``whole_logits_bytes`` on top of everything else
the job holds) and the auto budget's margin must stay under the device's ceiling (``offload.gpu_memory_limit``,
else the GPU's memory); then the job keeps transformers' loss. Without a ceiling (a CPU job without a limit)
there is nothing to size them against: the loss chunks above ``CHUNK_ABOVE_BYTES``, as the estimate counts it.

Example:
    >>> decision = decide_loss_logits(load_job_spec(Path("configs/hf_causal_lm_lora_model-offload.yaml").read_text()))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobs.fit.budget import device_ceiling
from jobs.fit.sizes import human_bytes
from jobs.models.registry import family_of
from jobs.spec.job import JobSpec
from offload.auto_budget import margin_bytes

if TYPE_CHECKING:
    from jobs.fit.estimate import MemoryEstimate


@dataclass(frozen=True)
class LossLogitsDecision:
    """What one job's loss does with its logits: ``whole`` (transformers' loss) or chunked, and why."""

    whole: bool
    message: str


def with_loss_logits_decided(spec: JobSpec, estimate: MemoryEstimate) -> MemoryEstimate:
    """``estimate`` (made with the logits chunked where the loss can chunk them) with the decision taken: the peak
    with the whole logits where they fit, and a note saying which and why."""
    if not estimate.whole_logits_peak_bytes:
        return estimate  # the loss would not chunk them: nothing to decide
    decision = _decided(spec, estimate)
    peak = estimate.whole_logits_peak_bytes if decision.whole else estimate.peak_device_bytes
    notes = [*estimate.notes, decision.message]
    return dataclasses.replace(estimate, peak_device_bytes=peak, loss_logits=decision, notes=notes)


def decide_loss_logits(spec: JobSpec) -> LossLogitsDecision | None:
    """The job's decision, as its fit check takes it; None where there is none to take: a family whose loss does not
    choose, no ceiling to size the logits against (the loss chunks above its threshold), or logits the loss would
    make at once anyway."""
    if family_of(spec.model).whole_logits_bytes is None or device_ceiling(spec)[0] is None:
        return None
    from jobs.fit.estimate import estimate_memory  # the estimate asks this module in turn

    return estimate_memory(spec).loss_logits


def _decided(spec: JobSpec, estimate: MemoryEstimate) -> LossLogitsDecision:
    ceiling, source = device_ceiling(spec)
    whole = human_bytes(estimate.whole_logits_peak_bytes)
    if ceiling is None:
        return LossLogitsDecision(
            False,
            "loss: chunked (the head recomputed chunk by chunk in backward): no offload.gpu_memory_limit and no GPU "
            f"here to size the whole logits' peak of {whole} against",
        )
    margin = margin_bytes(ceiling)
    sizes = f"the estimated peak with the whole logits, {whole}, and a margin of {human_bytes(margin)}"
    if estimate.whole_logits_peak_bytes + margin <= ceiling:
        return LossLogitsDecision(True, f"loss: transformers' own, the logits at once: {sizes} fit {source} "
                                        f"{human_bytes(ceiling)}")  # fmt: skip
    return LossLogitsDecision(
        False,
        f"loss: chunked (the head recomputed chunk by chunk in backward, peak {human_bytes(estimate.peak_device_bytes)}):"
        f" {sizes} exceed {source} {human_bytes(ceiling)}",
    )
