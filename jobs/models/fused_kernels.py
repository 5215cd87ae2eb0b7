"""``training.kernels: liger``: Liger-Kernel's fused Triton kernels in a model's decoder layers.

RMSNorm, RoPE and the SwiGLU/GeGLU MLP are swapped for Liger-Kernel's fused versions on the model instance
(``liger_kernel.transformers._apply_liger_kernel_to_instance``, which knows each architecture by its
``config.model_type``). Its fused linear + cross-entropy (and its cross-entropy) are always left off, whatever
Liger's defaults for the architecture: Ferry computes the loss from the logits itself (chunked where the family
does), and Liger's version only runs inside the model's own loss path, reading ``lm_head.weight`` in its own
kernel, past the head's ``forward``: past the offload engine's hooks that bring a streamed head to the device,
and past the dequantization of a quantized one (QLoRA quantizes the frozen head with the other linears).

The fused modules still call the layer's own projections (peft's LoRA layers over NF4 or int8 weights) and
read the norms' weights as parameters, so they compose with quantized, streamed frozen weights and with
``training.compile`` (jobs/models/compiled_blocks.py: the forwards Liger binds on each layer's modules are one
function, which the compiled block's guards see alike in every layer).

A family opts in through ``ModelFamily.apply_kernels``. The kernels are Triton, so they run only on CUDA and
only where ``liger-kernel`` imports (``pip install 'ferry[kernels]'``); anywhere else the plain path runs and
the job says so in a warning event.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from typing import Any, Literal

import torch
from torch import nn

log = logging.getLogger(__name__)
Notice = tuple[Literal["info", "warning"], str]  # a job event's level and message

# The kernels asked for by name; each apply function takes those it knows (its signature says which).
LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True, "layer_norm": True}
LIGER_OFF = {"cross_entropy": False, "fused_linear_cross_entropy": False}


def liger_available() -> bool:
    """Whether ``liger-kernel`` (and Triton under it) can be imported here."""
    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def apply_liger_kernels(model: nn.Module) -> list[str]:
    """Swap ``model``'s (a transformers ``PreTrainedModel``) layers for Liger's fused kernels where its
    architecture has them; returns the kernels applied (empty: none for this architecture)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply: Any = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type) if model_type else None
    if apply is None:
        return []
    accepted = inspect.signature(apply).parameters
    wanted = {name: on for name, on in {**LIGER_KERNELS, **LIGER_OFF}.items() if name in accepted}
    apply(model=model, **wanted)
    return [name for name, on in wanted.items() if on]


def fused_kernels_notice(choice: str, kind: str, apply: Any, model: nn.Module, device: torch.device) -> Notice | None:
    """Apply ``training.kernels`` (``choice``) to ``model`` of family ``kind``, whose ``apply_kernels`` is
    ``apply`` (None: the family has none); returns the job event's level and message, None for ``none``."""
    if choice == "none":
        return None
    if apply is None:
        return "warning", f"training.kernels: {choice} has no kernels for model.kind {kind}; the plain path runs"
    if device.type != "cuda":
        return (
            "warning",
            f"training.kernels: {choice} needs a CUDA device (this job runs on {device.type}); the plain path runs",
        )
    if not liger_available():
        return (
            "warning",
            f"training.kernels: {choice}, but liger-kernel does not import here (pip install 'ferry[kernels]'); "
            "the plain path runs",
        )
    applied = apply(model)
    if not applied:
        model_type = getattr(getattr(model, "config", None), "model_type", "?")
        return "warning", f"training.kernels: {choice} has no kernels for {model_type}; the plain path runs"
    log.info("Liger kernels applied: %s", ", ".join(applied))
    return "info", f"training.kernels: {choice}: fused {', '.join(applied)} (Liger-Kernel)"
