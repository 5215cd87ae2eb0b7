"""Ferry's recompute policy applied to a built model from outside (torchtitan's ``apply_ac``).

A model only turns its own checkpointing on (transformers' ``gradient_checkpointing_enable``, diffusers'
``enable_gradient_checkpointing``, ``transformer_lm``'s flag): each such module then calls its
``_gradient_checkpointing_func`` around a layer. ``apply_activation_checkpointing`` swaps Ferry's checkpoint
in there (checkpoint.py: reentrant, with the offload engine's hooks run in the recompute), so the models never
import the trainer's policy and the policy knows no model family.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import nn

from jobs.recompute.checkpoint import checkpoint_block, checkpoint_layer

if TYPE_CHECKING:
    from offload import ActivationOffload

log = logging.getLogger(__name__)
CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"  # where transformers and diffusers keep a layer's checkpoint


def apply_activation_checkpointing(model: nn.Module, *, uncheckpointed_layers: int = 0) -> int:
    """Checkpoint with Ferry's function every module of ``model`` whose checkpointing is on; leave the last
    ``uncheckpointed_layers`` layers whole (``leave_last_layers_whole``). Returns how many modules it set.

    transformers calls the function with the layer's ``forward`` (or ``__call__``) bound: ``checkpoint_layer``.
    diffusers and ``transformer_lm`` call it with the block: ``checkpoint_block``.
    """
    applied = 0
    for module in model.modules():
        if callable(getattr(module, CHECKPOINT_FUNCTION, None)):
            function = checkpoint_layer if _from_transformers(module) else checkpoint_block
            setattr(module, CHECKPOINT_FUNCTION, function)
            applied += 1
    if uncheckpointed_layers:
        leave_last_layers_whole(model, uncheckpointed_layers)
    return applied


def _from_transformers(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def leave_last_layers_whole(model: nn.Module, count: int) -> int:
    """Switch checkpointing off for the last ``count`` of ``model``'s layers that switch it per layer
    (transformers' ``GradientCheckpointingLayer``): they keep what they save for the backward and are not
    recomputed (``model.uncheckpointed_layers``). The last ones, as the backward starts with them: their saved
    activations are the first to go, and under the offload engine their weights are the ones still on the
    device at the turnaround. Returns how many were switched off."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    whole = layers[len(layers) - min(count, len(layers)) :]
    for layer in whole:
        layer.gradient_checkpointing = False
    return len(whole)


def offload_checkpointed_inputs(model: nn.Module, activations: ActivationOffload) -> int:
    """Send what each checkpointed call of ``model`` keeps to the host (``offload.activations``): every
    module's ``_gradient_checkpointing_func`` (transformers' layers, diffusers' blocks, ``transformer_lm``)
    runs under the engine's saved-tensor hooks. Returns how many were wrapped; none is a warning."""
    wrapped = 0
    for module in model.modules():
        function: Any = getattr(module, CHECKPOINT_FUNCTION, None)
        if callable(function):
            setattr(module, CHECKPOINT_FUNCTION, activations.wrap(function))
            wrapped += 1
    if not wrapped:
        log.warning("offload.activations: %s checkpoints no block through _gradient_checkpointing_func; nothing is "
                    "offloaded", type(model).__name__)  # fmt: skip
    return wrapped
