"""The fit check's activation formula for decoder-only language models (the built-in one and Llama-style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobs.models.family import activation_element_size
from jobs.recompute.chunked_loss import CHUNK_ABOVE_BYTES, chunk_tokens

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec


@dataclass(frozen=True)
class DecoderDims:
    """What the formula needs of a decoder: widths, depth, vocabulary, and the activations one block keeps.

    ``per_layer`` is (multiples of hidden_size, multiples of intermediate_size) saved per token per block:
    (9, 2) for the built-in GPT-style block, (10, 4) for a Llama-style one (gated MLP, RMSNorm, RoPE).
    ``mlp_tile_tokens``: the MLP runs over tiles of this many tokens, each checkpointed (jobs/recompute/tiled_mlp.py),
    so its intermediates (the ``intermediate_size`` multiples) exist for one tile at a time; None: whole.
    """

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    per_layer: tuple[int, int]
    chunked_logits: bool = False  # the loss makes its logits a chunk at a time when large (chunked_loss.py)
    mlp_tile_tokens: int | None = None
    # Whether a block's forward draws random numbers in training (dropout): a checkpointed block then keeps all
    # of a DPO batch's rows (jobs/recompute/checkpoint.py). Unknown counts as yes.
    draws_random_numbers: bool = True
    # With checkpointing: how many layers (the last) are left whole, keeping all they save for the backward.
    uncheckpointed_layers: int = 0


def decoder_activation_bytes(spec: JobSpec, dims: DecoderDims, *, whole_logits: bool = False) -> int:
    """Bytes of activations at the peak of one micro-batch of ``spec`` for a decoder of ``dims``: with the loss's
    logits made a chunk at a time where they are large and the model can (``chunked_lm_loss``), or, with
    ``whole_logits``, all at once (transformers' own loss)."""
    e = activation_element_size(spec)
    h, i, layers = dims.hidden, dims.intermediate, dims.layers
    seq_len = getattr(spec.data, "seq_len", None)
    if seq_len is None:
        raise ValueError(
            f"model.kind={spec.model.kind} trains on token data with a seq_len; got data.kind={spec.data.kind}"
        )
    n = rows_per_micro_batch(spec) * seq_len
    kept_tokens = rows_with_gradient(spec, dims) * seq_len  # what checkpointing keeps, recomputes, backpropagates
    # A tiled MLP's intermediates are one tile's, in the block's backward; forward keeps only the tiles' inputs.
    tiled = dims.mlp_tile_tokens is not None

    def saved_by_a_layer(tokens: int) -> tuple[int, int]:  # (the hidden-size part, the MLP's intermediates)
        mlp_tokens = min(tokens, dims.mlp_tile_tokens) if dims.mlp_tile_tokens is not None else tokens
        return tokens * dims.per_layer[0] * h * e, mlp_tokens * dims.per_layer[1] * i * e

    rest, mlp = saved_by_a_layer(n)
    layer = rest + mlp
    if (
        spec.training.gradient_checkpointing
    ):  # each block's input is kept; its recompute and backward come one at a time
        # A layer's forward without a graph runs all n tokens: at most what it would save of them at once.
        recomputed = sum(saved_by_a_layer(kept_tokens))
        whole = dims.uncheckpointed_layers  # these save all a layer saves, every row (none is recomputed)
        kept, block_backward = (layers - whole) * kept_tokens * h * e + whole * layer, max(2 * recomputed, layer)
    else:
        kept, block_backward = layers * (rest if tiled else layer), layer
    # The loss's logits are gone before the blocks' backward starts, so the peak is the larger of the two phases
    # on top of what is kept (adding both phases overestimates a measured LoRA peak; docs hold the comparison).
    logits_tokens = n
    if not whole_logits and chunks_logits(spec, dims):
        logits_tokens = min(n, chunk_tokens(dims.vocab))
    logits = logits_tokens * dims.vocab * loss_bytes_per_logit(e)
    return kept + max(logits, block_backward) + 4 * n * h * e  # + embeddings and final norm


def decoder_whole_logits_bytes(spec: JobSpec, dims: DecoderDims) -> int | None:
    """How many bytes more the activations' peak is with the loss's logits made all at once than chunk by chunk
    (0 where a block's backward is the peak either way); None where the loss would not chunk them (small
    logits, a model it cannot split)."""
    if not chunks_logits(spec, dims):
        return None
    return decoder_activation_bytes(spec, dims, whole_logits=True) - decoder_activation_bytes(spec, dims)


def chunks_logits(spec: JobSpec, dims: DecoderDims) -> bool:
    """Whether the chunked loss would split a micro-batch's logits unless the job keeps them whole: a model it can
    split, float32 logits above ``CHUNK_ABOVE_BYTES``."""
    tokens = rows_per_micro_batch(spec) * (getattr(spec.data, "seq_len", None) or 0)
    return dims.chunked_logits and tokens * dims.vocab * 4 > CHUNK_ABOVE_BYTES


def loss_bytes_per_logit(element_size: int) -> int:
    """Bytes per logit (position x vocabulary entry) at the peak of transformers' causal-LM loss.

    Its forward holds the head's logits (``element_size``), their float32 copy and the float32 log-softmax
    (cross-entropy's saved output): ``element_size + 8``; the head's logits are freed once the loss is taken
    (the caller keeps only the loss). Its backward holds the saved log-softmax, its gradient and the float32
    logits' gradient: 12. A float32 model's copy is the logits themselves (8 in forward). The chunked loss holds
    the same per logit of one chunk (tests/jobs/recompute/test_chunked_loss.py counts the live bytes).
    """
    return max(element_size + 8, 12)


def decoder_checkpointed_inputs(spec: JobSpec, dims: DecoderDims) -> list[int]:
    """What checkpointing keeps of a decoder: each block's input (batch x tokens x hidden), block by block."""
    seq_len = getattr(spec.data, "seq_len", None) or 0
    kept = rows_with_gradient(spec, dims) * seq_len * dims.hidden * activation_element_size(spec)
    return [kept] * (dims.layers - dims.uncheckpointed_layers)


def rows_per_micro_batch(spec: JobSpec) -> int:
    """The rows one forward runs: ``batch_size`` for SFT; a preference batch's pairs are two rows each
    (chosen, rejected), and LoRA DPO doubles them again with its reference rows (jobs/objectives/preference.py);
    a grpo micro-batch holds each prompt's ``num_generations`` completions (jobs/objectives/grpo.py)."""
    rows = spec.training.batch_size
    objective = getattr(spec.training, "objective", "sft")
    if objective == "grpo":
        return rows * spec.training.grpo.num_generations
    if objective != "sft":
        rows *= 2
    if objective == "dpo" and getattr(spec, "lora", None) is not None:
        rows *= 2
    return rows


def rows_with_gradient(spec: JobSpec, dims: DecoderDims) -> int:
    """The rows a checkpointed block keeps, recomputes and backpropagates: LoRA DPO's reference rows need no
    gradient, so where its blocks draw no random numbers (no dropout: ``lora.dropout`` and the model's) they
    are left out, half the forward's rows (jobs/recompute/checkpoint.py)."""
    rows = rows_per_micro_batch(spec)
    lora = getattr(spec, "lora", None)
    if (
        getattr(spec.training, "objective", "sft") == "dpo"
        and lora is not None
        and spec.training.gradient_checkpointing
        and not lora.dropout
        and not dims.draws_random_numbers
    ):
        return rows // 2
    return rows
