"""A GPT-style decoder-only language model, built in so jobs can train one of any size without downloads.

Module names follow the seed's LoRA example (diffusers' attention: ``to_q``, ``to_k``, ``to_v``,
``to_out.0``; feed-forward ``mlp.net.0`` / ``mlp.net.2``), so its ``--lora_target_modules`` carry over.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from jobs.spec import TransformerLMSpec


class Attention(nn.Module):
    """Causal multi-head self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.to_q = nn.Linear(hidden_size, hidden_size)
        self.to_k = nn.Linear(hidden_size, hidden_size)
        self.to_v = nn.Linear(hidden_size, hidden_size)
        self.to_out = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (proj(x).view(b, s, self.num_heads, -1).transpose(1, 2) for proj in (self.to_q, self.to_k, self.to_v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.to_out(y.transpose(1, 2).reshape(b, s, h))


class FeedForward(nn.Module):
    """Linear → GELU → Linear, named ``net`` like diffusers' FeedForward."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(hidden_size, intermediate_size),
            nn.GELU(approximate="tanh"),
            nn.Linear(intermediate_size, hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, spec: TransformerLMSpec) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size)
        self.attn = Attention(spec.hidden_size, spec.num_heads, spec.dropout)
        self.norm2 = nn.LayerNorm(spec.hidden_size)
        self.mlp = FeedForward(spec.hidden_size, spec.intermediate_size or 4 * spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Token + learned position embeddings, ``num_layers`` blocks, a final norm and an untied LM head.

    ``forward(input_ids, labels)`` returns the next-token cross-entropy when labels are given, else logits.
    """

    def __init__(self, spec: TransformerLMSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_positions = nn.Embedding(spec.max_seq_len, spec.hidden_size)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
        self.norm = nn.LayerNorm(spec.hidden_size)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                # Non-reentrant checkpointing re-runs the block in backward; the offload engine sees the
                # recompute through its forward hooks and keeps the block's weights on the device for it.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _init_weights(model: TransformerLM, seed: int) -> None:
    """GPT-2 style init: N(0, 0.02) matrices, zero biases, unit norms.

    Each matrix draws from its own generator seeded by (seed, index), so the result does not depend on
    thread scheduling and the matrices can be filled in parallel (torch releases the GIL): a
    multi-billion-parameter model initializes in seconds on a many-core host, not minutes.
    """

    def fill(index: int, name: str, param: torch.Tensor) -> None:
        with torch.no_grad():
            if ".norm" in name or name.startswith("norm."):
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed * 100_003 + index))

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda item: fill(item[0], *item[1]), enumerate(model.named_parameters())))


def build_transformer_lm(spec: TransformerLMSpec, seed: int) -> TransformerLM:
    """Build on the meta device, then allocate once on the CPU in the spec's dtype and initialize.

    Building on meta first avoids a float32 copy of a multi-billion-parameter model before the cast.
    """
    with torch.device("meta"):
        model = TransformerLM(spec)
    model = model.to_empty(device="cpu").to(getattr(torch, spec.dtype))
    if spec.weights is None:
        _init_weights(model, seed)
    else:
        model.load_state_dict(load_file(str(spec.weights)), strict=True)
    return model


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss; works for TransformerLM and Hugging Face causal LMs (with or without peft)."""
    output = model(input_ids=batch["input_ids"], labels=batch["labels"])
    return output if isinstance(output, torch.Tensor) else output.loss
