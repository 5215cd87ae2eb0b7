"""A GPT-style decoder-only language model, built in so jobs can train one of any size without downloads.

Module names follow the seed's LoRA example (diffusers' attention: ``to_q``, ``to_k``, ``to_v``,
``to_out.0``; feed-forward ``mlp.net.0`` / ``mlp.net.2``), so its ``--lora_target_modules`` carry over.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from safetensors.torch import load_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from jobs.errors import Problem
from jobs.models.decoder_activations import DecoderDims, decoder_activation_bytes, decoder_checkpointed_inputs
from jobs.models.family import ModelFamily, linear_module_names
from jobs.models.loading.weight_sources import SafetensorsSource, SeededInitSource, WeightSource
from jobs.spec.sections import Dtype, ModelPath, Section, broken_rules

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec

BYTE_VOCAB = 257  # the built-in byte tokenizer's vocabulary (jobs/data/tokenizers.py)


class TransformerLMSpec(Section):
    """A GPT-style decoder built in; from a few thousand to several billion parameters."""

    kind: Literal["transformer_lm"]
    vocab_size: int = Field(32000, gt=0)
    hidden_size: int = Field(768, gt=0)
    num_layers: int = Field(12, gt=0)
    num_heads: int = Field(12, gt=0)
    intermediate_size: int | None = Field(None, gt=0, description="default: 4 * hidden_size")
    max_seq_len: int = Field(1024, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    weights: ModelPath | None = Field(None, description="safetensors file under a model root; random init if null")
    dtype: Dtype = "float32"
    quantize: Literal["nf4", "int8"] | None = Field(
        None, description="store, stream and keep the frozen base's linear weights quantized (QLoRA); needs lora"
    )

    @model_validator(mode="after")
    def _check_heads_divide_hidden(self) -> TransformerLMSpec:
        if self.hidden_size % self.num_heads:
            raise broken_rules([("num_heads", f"must divide hidden_size ({self.hidden_size}); got {self.num_heads}")])
        return self


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


def _torch_checkpoint(block: nn.Module, *args: Any) -> torch.Tensor:
    """torch's non-reentrant checkpoint of ``block(*args)``: the model's default, as transformers' and diffusers'."""
    return checkpoint(block, *args, use_reentrant=False)


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
        # torch's checkpoint until the trainer swaps its own in (jobs/recompute/apply.py), as in transformers.
        self._gradient_checkpointing_func: Callable[..., torch.Tensor] = _torch_checkpoint

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # ``attention_mask`` comes with right-padded batches; causal attention already keeps real tokens from
        # seeing the padding after them, and padded labels are -100, so it changes nothing here.
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                # The block re-runs in backward (jobs/recompute/checkpoint.py); the offload engine sees
                # the recompute through its forward hooks and keeps the block's weights on the device for it.
                x = self._gradient_checkpointing_func(block, x)
            else:
                x = block(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def init_tensor(seed: int) -> Callable[[int, str, torch.Tensor], None]:
    """GPT-2 style init of the ``index``-th parameter ``name``: N(0, 0.02) matrices, zero biases, unit norms.

    Each matrix draws from its own generator seeded by (seed, index), so the result does not depend on
    thread scheduling or on where the tensor lives (an ordinary CPU tensor or its pinned host copy)."""

    def fill(index: int, name: str, param: torch.Tensor) -> None:
        with torch.no_grad():
            if ".norm" in name or name.startswith("norm."):
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed * 100_003 + index))

    return fill


def _init_weights(model: TransformerLM, seed: int) -> None:
    """`init_tensor` over every parameter, in parallel (torch releases the GIL): a multi-billion-parameter
    model initializes in seconds on a many-core host, not minutes."""
    fill = init_tensor(seed)
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


def build_transformer_lm_on_meta(
    spec: TransformerLMSpec, seed: int, device: torch.device
) -> tuple[TransformerLM, WeightSource]:
    """The model on the meta device and what fills its pinned host copies: the weights file, or the same
    seeded init as `build_transformer_lm` (bitwise)."""
    model = meta_transformer_lm(spec).to(getattr(torch, spec.dtype))
    if spec.weights is None:
        return model, SeededInitSource(model, init_tensor(seed))
    return model, SafetensorsSource.from_files(model, [Path(spec.weights)])


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss; works for TransformerLM and Hugging Face causal LMs (with or without peft)."""
    # Packed rows bring position_ids (restarting per document), padded batches an attention_mask.
    extra = {name: batch[name] for name in ("position_ids", "attention_mask") if name in batch}
    output = model(input_ids=batch["input_ids"], labels=batch["labels"], **extra)
    return output if isinstance(output, torch.Tensor) else output.loss


def meta_transformer_lm(spec: TransformerLMSpec) -> TransformerLM:
    """The model's shapes on the meta device."""
    with torch.device("meta"):
        return TransformerLM(spec)


def transformer_lm_activation_bytes(spec: JobSpec, model: nn.Module) -> int:
    """The built-in GPT-style block keeps 9 hidden-wide and 2 intermediate-wide tensors per token."""
    return decoder_activation_bytes(spec, _dims(spec))


def transformer_lm_checkpointed_inputs(spec: JobSpec, model: nn.Module) -> list[int]:
    """Each block's input, which ``checkpoint_block`` keeps."""
    return decoder_checkpointed_inputs(spec, _dims(spec))


def _dims(spec: JobSpec) -> DecoderDims:
    m = spec.model
    assert isinstance(m, TransformerLMSpec)
    intermediate = m.intermediate_size or 4 * m.hidden_size
    return DecoderDims(
        m.hidden_size, intermediate, m.num_layers, m.vocab_size, (9, 2), draws_random_numbers=m.dropout > 0
    )


def _check_tokenizer_fits_vocab(spec: JobSpec) -> list[Problem]:
    model, data = spec.model, spec.data
    if not isinstance(model, TransformerLMSpec) or data.kind != "text":
        return []
    problems = []
    if data.tokenizer.kind == "byte" and model.vocab_size < BYTE_VOCAB:
        problems.append(
            ("model.vocab_size", f"the byte tokenizer needs vocab_size >= {BYTE_VOCAB}; got {model.vocab_size}")
        )
    if data.seq_len > model.max_seq_len:
        problems.append(("data.seq_len", f"must be <= model.max_seq_len ({model.max_seq_len}); got {data.seq_len}"))
    return problems


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    # Under LoRA the TransformerLM sits inside peft's wrappers.
    for module in model.modules():
        if isinstance(module, TransformerLM):
            module.gradient_checkpointing = True


FAMILY = ModelFamily(
    kind="transformer_lm",
    spec=TransformerLMSpec,
    build=build_transformer_lm,
    loss=lm_loss,
    data_kinds=("text",),
    meta_model=meta_transformer_lm,
    activation_bytes=transformer_lm_activation_bytes,
    lora_target_names=lambda spec: linear_module_names(meta_transformer_lm(spec)),
    enable_gradient_checkpointing=_enable_gradient_checkpointing,
    rules=(_check_tokenizer_fits_vocab,),
    build_on_meta=build_transformer_lm_on_meta,
    checkpointed_inputs=transformer_lm_checkpointed_inputs,
)
