"""Module names of a Hugging Face model from its ``config.json`` alone: built on the meta device, no weights."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def hf_module_names(path: Path) -> dict[str, bool]:
    """Dotted names of every module of the causal LM that ``path/config.json`` describes, each with whether
    peft's LoRA can wrap it (a Linear, Embedding or convolution; not a container such as ``mlp`` or ``layers.1``).

    The model is instantiated on the meta device, so a 70B config costs milliseconds and no memory.
    """
    from transformers import AutoModelForCausalLM

    from jobs.models.hf_architecture import causal_lm_config

    config = causal_lm_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return {name: lora_can_wrap(module) for name, module in model.named_modules() if name}


def lora_can_wrap(module: torch.nn.Module) -> bool:
    """Whether peft's LoRA has a layer for ``module``'s type; peft raises on any other module a target matches."""
    from transformers.pytorch_utils import Conv1D

    wrapped = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)
    return isinstance(module, wrapped)
