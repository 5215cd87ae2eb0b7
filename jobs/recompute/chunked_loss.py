"""A causal LM's next-token loss over a few thousand tokens at a time: the whole sequence's logits never exist.

transformers computes the loss from the logits of every position, upcast to float32: at 32768 tokens and a
152064-token vocabulary that is 20 GB of float32 logits plus 10 GB of bf16 ones, on top of what the blocks need,
more than a 24 GiB card holds whatever the offload engine does with the weights and the blocks' inputs. Here
the decoder runs as usual and returns its hidden states; the head and the cross-entropy run over chunks of
positions, each chunk checkpointed (its logits are made again in backward, one chunk at a time). The loss is
transformers' (float32 logits, labels shifted by one, -100 ignored, the sum over the batch's counted tokens);
only the order of the sum differs, so it equals it to float rounding, not bit for bit
(tests/jobs/recompute/test_chunked_loss.py).

Chunking costs the head's matmul again in backward, so a job chunks only where it needs to: its float32 logits
exceed ``CHUNK_ABOVE_BYTES`` and the fit check's estimate with the whole logits (jobs/fit/loss_logits.py) would not fit
the job's device (``offload.gpu_memory_limit``, else the GPU's memory). A job that has room keeps transformers'
loss (``keep_logits_whole``); a model no job decided for (a CPU job without a limit: no device to measure the room
against, and the host's memory is shared with the engine's pinned copies) chunks above the threshold. Models with
logit soft-capping, or whose decoder and head cannot be found, keep transformers' loss. The preference objectives'
per-row log-probs (jobs/objectives/preference.py) are computed the same way (``chunked_completion_logps``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from jobs.recompute.flags import rows_from, rows_needing_gradient

CHUNK_ABOVE_BYTES = 2**30  # float32 logits above this are computed in chunks, unless the job has room for them
CHUNK_BYTES = 2**29  # each chunk's float32 logits (bf16 ones and the gradient come on top)
IGNORE_INDEX = -100
_WHOLE_ATTRIBUTE = "_ferry_loss_logits_whole"  # the job's decision, on the model the loss unwraps to


def keep_logits_whole(model: nn.Module, whole: bool) -> None:
    """Record the job's decision on ``model``: ``whole``, its loss is transformers' own whatever the logits'
    size (the device has room for them); otherwise chunked above ``CHUNK_ABOVE_BYTES``."""
    base = _unwrapped(model)
    base.__dict__[_WHOLE_ATTRIBUTE] = whole  # not a submodule, not in the state dict


def logits_kept_whole(model: nn.Module) -> bool:
    """Whether the job decided ``model``'s loss keeps its logits whole (`keep_logits_whole`)."""
    return bool(_unwrapped(model).__dict__.get(_WHOLE_ATTRIBUTE, False))


def chunk_tokens(vocab: int) -> int:
    """Positions per chunk for a vocabulary of ``vocab``."""
    return max(1, CHUNK_BYTES // (vocab * 4))


def chunked_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The next-token loss of ``batch`` computed chunk by chunk; None when ``model`` is not one it can split
    (the caller then asks the model for its own loss), the logits are small enough to make at once, or the job
    has room for them (`keep_logits_whole`)."""
    chunked = _chunked_nll(model, batch, batch["labels"])
    if chunked is None:
        return None
    nll, counted = chunked
    return nll.sum() / counted.sum().clamp(min=1)


def chunked_completion_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row: the summed log-prob of ``labels``' counted tokens and how many there are, computed chunk by
    chunk as `chunked_lm_loss` computes the loss (a preference objective's log-probs: DPO doubles the batch
    with its reference rows, so 4096 tokens a step are 8192 rows' worth of logits, 5 GB of float32 at a
    152064-token vocabulary). None when ``model`` cannot be split or the logits are small enough."""
    chunked = _chunked_nll(model, batch, labels)
    return None if chunked is None else (-chunked[0], chunked[1])


def _chunked_nll(
    model: nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row: the negative log-likelihood summed over ``labels``' counted tokens (float32) and their count,
    the head and its cross-entropy run a checkpointed chunk of positions at a time; None as above."""
    parts = _decoder_and_head(model)
    if parts is None:
        return None
    decoder, head, vocab = parts
    if labels.numel() * vocab * 4 <= CHUNK_ABOVE_BYTES or logits_kept_whole(model):
        return None
    extra = {name: batch[name] for name in ("position_ids", "attention_mask") if name in batch}
    hidden = decoder(input_ids=batch["input_ids"], **extra).last_hidden_state
    return chunked_nll(head, hidden, labels)


def chunked_nll(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the negative log-likelihood of ``labels`` (shifted by one, -100 ignored) from the decoder's
    ``hidden`` states through ``head``, a checkpointed chunk of positions at a time, and the counted tokens;
    for a model whose decoder takes more than token ids (a vision-language model's images)."""
    weight: Any = head.weight
    vocab = int(getattr(head, "out_features", 0) or weight.shape[0])
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # position t predicts token t + 1
    step = chunk_tokens(vocab)
    total = hidden.new_zeros(labels.shape[0], dtype=torch.float32)
    kept = rows_needing_gradient(labels.shape[0])  # DPO's reference rows: no gradient, so no recompute either
    for start in range(0, hidden.shape[1], step):
        end = min(start + step, hidden.shape[1])
        if kept is None:
            chunk = checkpoint(_chunk_nll, head, hidden[:, start:end], targets[:, start:end], use_reentrant=False)
        else:
            policy = checkpoint(
                _chunk_nll, head, hidden[:kept, start:end], targets[:kept, start:end], use_reentrant=False
            )
            with torch.no_grad(), rows_from(kept):
                reference = _chunk_nll(head, hidden[kept:, start:end], targets[kept:, start:end])
            chunk = torch.cat([policy, reference])
        total = total + chunk
    return total, (targets != IGNORE_INDEX).sum(-1)


def _chunk_nll(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # as transformers' loss: float32 logits
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return nll.view(targets.shape).sum(-1)  # an ignored position contributes 0


def _unwrapped(model: nn.Module) -> Any:
    get_base = getattr(model, "get_base_model", None)  # peft's wrapper
    return get_base() if callable(get_base) else model


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module, int] | None:
    base = _unwrapped(model)
    config = getattr(base, "config", None)
    prefix = getattr(base, "base_model_prefix", None)
    if config is None or not prefix or getattr(config, "final_logit_softcapping", None) is not None:
        return None
    if getattr(config, "logit_scale", None) is not None:  # a head that scales its logits (Cohere)
        return None
    decoder = getattr(base, prefix, None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module) or not vocab:
        return None
    return decoder, head, int(vocab)
