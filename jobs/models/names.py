"""Module names of the built-in models, known without allocating weights (for spec checks and estimates)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from jobs.spec import ToyMLPSpec, TransformerLMSpec


def meta_model(spec: ToyMLPSpec | TransformerLMSpec) -> nn.Module:
    """The built-in model on the meta device: shapes and names, no memory."""
    from jobs.models.toy_mlp import ToyMLP
    from jobs.models.transformer_lm import TransformerLM

    with torch.device("meta"):
        if spec.kind == "toy_mlp":
            return ToyMLP(spec.hidden_size, spec.num_layers)
        return TransformerLM(spec)


def builtin_module_names(spec: ToyMLPSpec | TransformerLMSpec) -> list[str]:
    """Names of the Linear modules of a built-in model (the ones LoRA can target)."""
    return [name for name, module in meta_model(spec).named_modules() if isinstance(module, nn.Linear)]


def lora_target_matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of target names: the whole name, or its last dotted components."""
    return module_name == target or module_name.endswith("." + target)
