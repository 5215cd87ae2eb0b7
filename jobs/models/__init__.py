"""Models chosen by ``model.kind``. Each builder returns a CPU model; the runner decides where it goes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from jobs.models.hf_causal_lm import build_hf_causal_lm
from jobs.models.toy_mlp import ToyMLP, build_toy_mlp, toy_loss
from jobs.models.transformer_lm import TransformerLM, build_transformer_lm, lm_loss

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]

# kind -> (builder(spec, seed) -> CPU model, loss(model, batch) -> scalar)
MODELS: dict[str, tuple[Callable[..., nn.Module], LossFn]] = {
    "toy_mlp": (build_toy_mlp, toy_loss),
    "transformer_lm": (build_transformer_lm, lm_loss),
    "hf_causal_lm": (build_hf_causal_lm, lm_loss),
}


def build_model(spec: object, seed: int) -> tuple[nn.Module, LossFn]:
    """Build ``spec`` (a model section) on the CPU; return it with its loss function."""
    builder, loss_fn = MODELS[spec.kind]
    return builder(spec, seed), loss_fn


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Turn on activation checkpointing (non-reentrant, which LoRA's frozen inputs need)."""
    if isinstance(model, TransformerLM):
        model.gradient_checkpointing = True
    elif hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(f"training.gradient_checkpointing is not supported for {type(model).__name__}")


__all__ = ["MODELS", "LossFn", "ToyMLP", "TransformerLM", "build_model", "enable_gradient_checkpointing"]
