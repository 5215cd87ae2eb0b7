"""The device memory a decode loop needs besides the weights: its KV cache and its per-step working memory.

What the offload engine leaves room for when it holds the streamed units through generation
(``OffloadTrainingManager.hold_for_inference``): the cache grows to every row's prompt and completion, and the
prefill's activations and the logits' sampling are the largest working tensors of the loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def decode_memory_bytes(model: nn.Module, rows: int, prompt_width: int, max_new_tokens: int) -> int:
    """Bytes of the KV cache for ``rows x (prompt_width + max_new_tokens)`` positions in the weights' dtype, plus
    the prefill's widest activations (a layer's MLP over every prompt position) and the sampling's float32 logits,
    probabilities and sorted copies. A model without a transformers config (no KV cache) counts the activations
    of its widest window only, from its parameters' width."""
    config: Any = getattr(model, "config", None)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    size = torch.finfo(dtype).bits // 8
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    if not hidden:
        widest = max((p.shape[0] for p in model.parameters() if p.dim() == 2), default=0)
        return 4 * rows * (prompt_width + max_new_tokens) * widest * 4
    intermediate = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    cache = kv_cache_bytes(text, rows, prompt_width + max_new_tokens, size)
    prefill = rows * prompt_width * (4 * hidden + 3 * intermediate) * size
    sampling = rows * vocab * 4 * 5  # logits, probabilities, their sorted copy, the nucleus mask and order
    return cache + prefill + sampling


def kv_cache_bytes(text_config: Any, rows: int, positions: int, element_size: int) -> int:
    """A full-attention KV cache's bytes: keys and values of every layer for ``rows x positions`` tokens."""
    hidden = int(text_config.hidden_size)
    layers = int(getattr(text_config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(text_config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or hidden // heads)
    return 2 * layers * kv_heads * head_dim * rows * positions * element_size
