"""A Hugging Face causal LM from a local directory: how users bring their own models."""

from __future__ import annotations

import torch
from torch import nn

from jobs.spec import HFCausalLMSpec


def build_hf_causal_lm(spec: HFCausalLMSpec, seed: int) -> nn.Module:
    """Load ``spec.path`` on the CPU in the spec's dtype; never downloads and never runs remote code."""
    from transformers import AutoModelForCausalLM  # transformers is slow to import; only this model needs it

    torch.manual_seed(seed)  # weights absent from the files (if any) are initialized reproducibly
    model = AutoModelForCausalLM.from_pretrained(
        str(spec.path), dtype=getattr(torch, spec.dtype), local_files_only=True, trust_remote_code=False
    )
    model.config.use_cache = False  # a KV cache is useless in training and costs memory
    return model
