"""Recompute: what backward runs again instead of keeping (ground floor: imports nothing else from ``jobs``).

Three techniques trade compute for activation memory, applied to a model from outside (``apply.py``):

- activation checkpointing (``checkpoint.py``): a layer keeps only its inputs and runs again in backward;
- the tiled MLP (``tiled_mlp.py``): a decoder layer's MLP over tiles of the sequence, each checkpointed;
- the chunked loss (``chunked_loss.py``): the head and cross-entropy a checkpointed chunk of positions at a time.

They cooperate through one protocol, three flags set by context managers and read by named readers
(``flags.py``):

- ``only_first_rows_need_gradient(rows)`` / ``rows_needing_gradient(total)``: set by the preference objectives
  around DPO's LoRA reference rows, which ride the policy's forward but need no gradient; read by checkpointed
  layers (they keep and recompute the first rows only) and by the chunked loss (no recompute for the others).
- ``rows_from(first)`` / ``batch_rows(rows)``: set by the chunked loss around the reference rows it computes
  apart; read by per-row state (the preference objectives' masks) to find its rows of the batch.
- ``in_recompute()`` / ``recomputing()``: set by a checkpoint while it recomputes; read by the tiled MLP, which
  skips a forward whose value nothing reads there.

What a recompute must replay of its forward (random numbers, autocast) is captured once in ``replay.py``.
"""

from jobs.recompute.apply import (
    CHECKPOINT_FUNCTION,
    apply_activation_checkpointing,
    leave_last_layers_whole,
    offload_checkpointed_inputs,
)
from jobs.recompute.checkpoint import checkpoint_block, checkpoint_layer
from jobs.recompute.flags import (
    batch_rows,
    in_recompute,
    only_first_rows_need_gradient,
    recomputing,
    rows_from,
    rows_needing_gradient,
)
from jobs.recompute.replay import ForwardState

__all__ = [
    "CHECKPOINT_FUNCTION",
    "ForwardState",
    "apply_activation_checkpointing",
    "batch_rows",
    "checkpoint_block",
    "checkpoint_layer",
    "in_recompute",
    "leave_last_layers_whole",
    "offload_checkpointed_inputs",
    "only_first_rows_need_gradient",
    "recomputing",
    "rows_from",
    "rows_needing_gradient",
]
