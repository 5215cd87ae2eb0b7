"""Models chosen by ``model.kind``, one `ModelFamily` each (jobs/models/registry.py lists them).

Each builder returns a CPU model; the runner decides where it goes.
"""

from __future__ import annotations

from torch import nn

from jobs.models.family import LossFn, ModelFamily
from jobs.models.registry import FAMILIES, family_of
from jobs.models.toy_mlp import ToyMLP
from jobs.models.transformer_lm import TransformerLM


def build_model(spec: object, seed: int) -> tuple[nn.Module, LossFn]:
    """Build ``spec`` (a model section) on the CPU; return it with its loss function."""
    family = family_of(spec)
    return family.build(spec, seed), family.loss


def enable_gradient_checkpointing(model: nn.Module, spec: object) -> None:
    """Turn on activation checkpointing for ``model`` built from the model section ``spec``."""
    enable = family_of(spec).enable_gradient_checkpointing
    if enable is None:  # refused at submit time by rules.py; a programmatic caller gets the same words
        raise ValueError(f"training.gradient_checkpointing is not supported for model.kind={family_of(spec).kind}")
    enable(model)  # the model's own mechanism; the trainer applies Ferry's recompute policy to it (jobs/recompute)


__all__ = [
    "FAMILIES",
    "LossFn",
    "ModelFamily",
    "ToyMLP",
    "TransformerLM",
    "build_model",
    "enable_gradient_checkpointing",
    "family_of",
]
