"""Prompt encoding as FluxPipeline and Flux2Pipeline do it.

- Flux.1: T5's last hidden state over the prompt padded to ``max_sequence_length`` tokens (the padding tokens'
  states included, as the pipeline passes them, with no mask), and CLIP-L's pooled output over 77 tokens
  (``FluxPipeline._get_t5_prompt_embeds`` / ``_get_clip_prompt_embeds``).
- Flux.2: the Mistral chat template with the pipeline's system message, padded to ``max_sequence_length``, and
  hidden states 10, 20 and 30 stacked along the width (``Flux2Pipeline._get_mistral_3_small_prompt_embeds``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FLUX2_HIDDEN_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers


def flux1_encode(encoder: nn.Module, tokenizer: Any, prompts: list[str], device: torch.device, max_len: int) -> list:
    """T5 over the prompt padded to ``max_len``: one ``[max_len, dim]`` embedding per prompt."""
    tokens = tokenizer(
        prompts, padding="max_length", max_length=max_len, truncation=True, return_tensors="pt"
    ).input_ids.to(device)
    return list(encoder(tokens, output_hidden_states=False)[0])


def flux1_pooled(encoder: nn.Module, tokenizer: Any, prompts: list[str], device: torch.device) -> list:
    """CLIP-L's pooled output over the prompt padded to the tokenizer's 77 tokens: one ``[dim]`` per prompt."""
    tokens = tokenizer(
        prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids.to(device)
    return list(encoder(tokens, output_hidden_states=False).pooler_output)


def flux2_encode(encoder: nn.Module, tokenizer: Any, prompts: list[str], device: torch.device, max_len: int) -> list:
    """Mistral's hidden states 10, 20, 30 of the chat-formatted prompt, side by side: ``[max_len, 3 dim]``."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    inputs = tokenizer.apply_chat_template(
        format_input(prompts=prompts, system_message=SYSTEM_MESSAGE),
        add_generation_prompt=False,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        padding="max_length",
        truncation=True,
        max_length=max_len,
    )
    output = encoder(
        input_ids=inputs["input_ids"].to(device),
        attention_mask=inputs["attention_mask"].to(device),
        output_hidden_states=True,
        use_cache=False,
    )
    stacked = torch.stack([output.hidden_states[k] for k in FLUX2_HIDDEN_LAYERS], dim=1)  # [B, 3, L, D]
    batch, layers, length, width = stacked.shape
    return list(stacked.permute(0, 2, 1, 3).reshape(batch, length, layers * width))
