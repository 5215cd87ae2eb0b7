"""Module names of a model family, known without allocating weights (for spec checks and estimates)."""

from __future__ import annotations

from torch import nn

from jobs.models.family import lora_target_matches  # where the families' own checks find it too
from jobs.models.registry import family_of

__all__ = ["builtin_module_names", "lora_target_matches", "meta_model"]


def meta_model(spec: object) -> nn.Module:
    """The model of a ``model:`` section on the meta device: shapes and names, no memory."""
    return family_of(spec).meta_model(spec)


def builtin_module_names(spec: object) -> list[str]:
    """Names of the Linear modules LoRA can target (empty when known only once the model is loaded)."""
    return family_of(spec).lora_target_names(spec) or []
