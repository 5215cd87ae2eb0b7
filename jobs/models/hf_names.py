"""Module names of a Hugging Face model from its ``config.json`` alone: built on the meta device, no weights."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_module_names(path: Path) -> list[str]:
    """Dotted names of every module of the causal LM that ``path/config.json`` describes.

    The model is instantiated on the meta device, so a 70B config costs milliseconds and no memory.
    """
    from transformers import AutoModelForCausalLM

    from jobs.models.hf_architecture import causal_lm_config

    config = causal_lm_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return [name for name, _ in model.named_modules() if name]
