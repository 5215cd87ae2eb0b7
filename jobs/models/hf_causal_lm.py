"""A Hugging Face causal LM from a local directory: how users bring their own models."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from jobs.checkpoints.export import HF_PRETRAINED
from jobs.models.decoder_activations import (
    DecoderDims,
    decoder_activation_bytes,
    decoder_checkpointed_inputs,
    decoder_whole_logits_bytes,
)
from jobs.models.family import ModelFamily
from jobs.models.fused_kernels import apply_liger_kernels
from jobs.models.hf_names import hf_module_names
from jobs.models.loading.hf_checkpoint import checkpoint_problems, checkpoint_source
from jobs.models.loading.weight_sources import RandomSource, WeightSource
from jobs.models.transformer_lm import lm_loss
from jobs.recompute import tiled_mlp
from jobs.recompute.chunked_loss import chunked_lm_loss
from jobs.spec.sections import Dtype, ModelPath, Section, broken_rules

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec


class HFCausalLMSpec(Section):
    """A Hugging Face causal LM from a local directory (``config.json`` + safetensors); no remote code."""

    kind: Literal["hf_causal_lm"]
    path: ModelPath
    dtype: Dtype = "bfloat16"
    quantize: Literal["nf4", "int8"] | None = Field(
        None, description="store, stream and keep the frozen base's linear weights quantized (QLoRA); needs lora"
    )
    init: Literal["checkpoint", "random"] = Field(
        "checkpoint",
        description="checkpoint: the safetensors in path; random: config.json only, weights drawn at random "
        "(N(0, initializer_range) matrices, unit norms; for benchmarking shapes without a checkpoint)",
    )
    tiled_mlp: bool | Literal["auto"] = Field(
        "auto",
        description="run each decoder layer's position-wise MLP over tiles of tiled_mlp_tokens tokens, each "
        "checkpointed, so a layer's backward holds one tile's MLP intermediates (the recompute of a checkpointed "
        "Llama-style layer skips its MLP; elsewhere one more MLP forward a step); "
        "auto: only where the job needs it to fit, that is with training.gradient_checkpointing and a memory "
        "estimate with whole MLPs above offload.gpu_memory_limit (or the GPU's memory)",
    )
    uncheckpointed_layers: int = Field(
        0,
        ge=0,
        description="with training.gradient_checkpointing: the last N decoder layers keep their activations for "
        "the backward instead of recomputing them, so a step runs N layers' forward once less, for their "
        "activations in memory (the fit check counts them); at most the model's layers",
    )
    tiled_mlp_tokens: int | None = Field(
        None,
        gt=0,
        description="tokens per MLP tile (all rows, a slice of positions); null: a power of two whose MLP "
        "intermediates take about 0.5 GiB in the model's dtype, at least 1024",
    )

    @model_validator(mode="after")
    def _check_tile_size_needs_tiling(self) -> HFCausalLMSpec:
        if self.tiled_mlp is False and self.tiled_mlp_tokens is not None:
            message = "sizes the MLP's tiles; set model.tiled_mlp: true or auto, or remove it"
            raise broken_rules([("tiled_mlp_tokens", message)])
        return self


def build_hf_causal_lm(spec: HFCausalLMSpec, seed: int) -> nn.Module:
    """Load ``spec.path`` on the CPU in the spec's dtype; never downloads and never runs remote code."""
    from transformers import AutoModelForCausalLM  # transformers is slow to import; only this model needs it

    torch.manual_seed(seed)  # weights absent from the files (if any) are initialized reproducibly
    if spec.init == "random":
        model = AutoModelForCausalLM.from_config(_config(spec), dtype=getattr(torch, spec.dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(spec.path), dtype=getattr(torch, spec.dtype), local_files_only=True, trust_remote_code=False
        )
    model.config.use_cache = False  # a KV cache is useless in training and costs memory
    _tile_mlps(model, spec)
    return model


def build_hf_causal_lm_on_meta(spec: HFCausalLMSpec, seed: int, device: torch.device) -> tuple[nn.Module, WeightSource]:
    """Weights on the meta device, buffers (rotary frequencies) real; filled by the safetensors shards of
    ``spec.path`` or, with ``init: random``, by seeded random values drawn on ``device``."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = _config(spec)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    # from_pretrained ties the output head to the input embedding (tie_word_embeddings); on the meta device
    # nothing has tied them yet. Tied, they are one tensor: one pinned copy, loaded once.
    model.tie_weights()
    model.config.use_cache = False
    _tile_mlps(model, spec)
    if spec.init == "random":
        return model, RandomSource(model, seed, getattr(config, "initializer_range", 0.02), device)
    return model, checkpoint_source(model, Path(spec.path), load=lambda: build_hf_causal_lm(spec, seed))


def _tile_mlps(model: nn.Module, spec: HFCausalLMSpec) -> None:
    """``model.tiled_mlp: true``: the MLPs run over tiles. ``auto`` is decided before the build, by the fit
    check (``jobs.fit.estimate.with_mlp_tiling_decided``); undecided, the MLPs run whole."""
    if spec.tiled_mlp is True:
        tiled_mlp.install(model, _tile_tokens(spec, model.config))


def _tile_tokens(spec: HFCausalLMSpec, config: Any) -> int:
    element_size = getattr(torch, spec.dtype).itemsize
    return spec.tiled_mlp_tokens or tiled_mlp.default_tile_tokens(_intermediate(config), element_size)


def _intermediate(config: Any) -> int:
    return int(getattr(config, "intermediate_size", None) or 4 * config.hidden_size)


def _config(spec: HFCausalLMSpec) -> Any:
    from jobs.models.hf_architecture import causal_lm_config

    return causal_lm_config(Path(spec.path))  # an architecture it cannot build: a one-line ValueError


def meta_hf_causal_lm(spec: HFCausalLMSpec) -> nn.Module:
    """The model's shapes on the meta device, from its ``config.json`` alone (no weight is read), its
    weights tied as ``from_pretrained`` ties them: a tied head is one tensor, counted and loaded once."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(spec))
    model.tie_weights()
    return model


def hf_checkpoint_problems(spec: HFCausalLMSpec) -> list[tuple[str, str, str]]:
    """What keeps ``spec.path``'s safetensors from filling the model as ``from_pretrained`` would, from the
    files' headers alone: (tensor, file, what is wrong). For ``init: random``, only that the config is one
    `AutoModelForCausalLM` builds (raises ValueError otherwise, as for a checkpoint)."""
    if spec.init == "random":
        _config(spec)
        return []
    problems = checkpoint_problems(meta_hf_causal_lm(spec), Path(spec.path))
    return [(p.tensor, p.file, p.message) for p in problems]


def hf_activation_bytes(spec: JobSpec, model: nn.Module) -> int:
    """Llama-style blocks (gated MLP, RMSNorm, rotary embeddings), sized from the model's config; the MLP's
    intermediates per tile where the job tiles them (``model.tiled_mlp``), the layers checkpointing leaves
    whole (``model.uncheckpointed_layers``) with all they save."""
    return decoder_activation_bytes(spec, _dims(model, _mlp_tile_tokens(spec, model), _uncheckpointed(spec)))


def hf_whole_logits_bytes(spec: JobSpec, model: nn.Module) -> int | None:
    """What ``hf_activation_bytes`` would grow by with transformers' loss (every position's logits at once) in
    place of the chunked one."""
    return decoder_whole_logits_bytes(spec, _dims(model, _mlp_tile_tokens(spec, model), _uncheckpointed(spec)))


def _uncheckpointed(spec: JobSpec) -> int:
    return getattr(spec.model, "uncheckpointed_layers", 0) if spec.training.gradient_checkpointing else 0


def _mlp_tile_tokens(spec: JobSpec, model: nn.Module) -> int | None:
    """Tokens per MLP tile in ``spec``'s job, or None where its MLPs run whole: as the built model decides
    (``auto`` counts as whole: the fit check compares that estimate with the device before deciding)."""
    section: Any = spec.model
    if section.tiled_mlp is not True or not tiled_mlp.tileable_mlps(model):
        return None
    return _tile_tokens(section, model.config)


def hf_checkpointed_inputs(spec: JobSpec, model: nn.Module) -> list[int]:
    """The checkpointed decoder layers' inputs, which transformers' checkpointing keeps (its other arguments are
    bound)."""
    return decoder_checkpointed_inputs(spec, _dims(model, uncheckpointed_layers=_uncheckpointed(spec)))


def _dims(model: nn.Module, mlp_tile_tokens: int | None = None, uncheckpointed_layers: int = 0) -> DecoderDims:
    config: Any = model.config
    h = config.hidden_size
    chunked = getattr(config, "final_logit_softcapping", None) is None and getattr(config, "logit_scale", None) is None
    layers, vocab = config.num_hidden_layers, config.vocab_size
    return DecoderDims(
        h,
        _intermediate(config),
        layers,
        vocab,
        (10, 4),
        chunked_logits=chunked,
        mlp_tile_tokens=mlp_tile_tokens,
        draws_random_numbers=_has_dropout(config.to_dict()),
        uncheckpointed_layers=min(uncheckpointed_layers, layers),
    )


def _has_dropout(values: dict[str, Any]) -> bool:
    """Whether a config sets any dropout probability (``attention_dropout``, GPT-2's ``resid_pdrop``...)."""
    for key, value in values.items():
        if isinstance(value, dict) and _has_dropout(value):
            return True
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if isinstance(key, str) and key.endswith(("dropout", "pdrop")) and numeric and value > 0:
            return True
    return False


def hf_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The next-token loss; over chunks of positions when the whole sequence's logits would be large
    (chunked_loss.py), else transformers' own."""
    loss = chunked_lm_loss(model, batch)
    return loss if loss is not None else lm_loss(model, batch)


def enable_hf_gradient_checkpointing(model: nn.Module) -> None:
    """Reentrant activation checkpointing of the decoder layers, under either transformers name.

    Reentrant, because the non-reentrant variant runs Python hooks for every tensor a layer saves, several
    times the Python calls of the reentrant one, which adds only the recomputed forward
    (tests/jobs/models/test_hf_checkpointing.py counts them); a step of small batches is bound by the host
    issuing kernels. The reentrant variant needs the layers' input to
    require grad, which LoRA's frozen embeddings do not give: ``enable_input_require_grads`` makes the
    embeddings' output require it (what transformers does itself for models fed ``input_ids``, and peft when
    it wraps a model that is not quantized). The decoder layers return one tensor, so no output goes without
    a gradient (the case ``jobs/recompute/checkpoint.py`` handles for the DiT). The trainer then swaps Ferry's
    checkpoint in (``jobs.recompute.apply_activation_checkpointing``), under which the layers' module hooks (the
    offload engine's) run in the recompute too.
    """
    enable: Any
    kwargs = {"use_reentrant": True}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        enable = model.activation_checkpointing_enable
        enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        enable = model.gradient_checkpointing_enable
        enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"training.gradient_checkpointing is not supported for {type(model).__name__}")
    if getattr(model, "_require_grads_hook", None) is None:  # not already hooked by transformers
        enable = model.enable_input_require_grads
        enable()


FAMILY = ModelFamily(
    kind="hf_causal_lm",
    spec=HFCausalLMSpec,
    build=build_hf_causal_lm,
    loss=hf_lm_loss,
    data_kinds=("text",),
    meta_model=meta_hf_causal_lm,
    activation_bytes=hf_activation_bytes,
    lora_target_names=lambda spec: None,  # not from the spec alone: preflight reads them from config.json
    module_names_from_files=lambda spec: hf_module_names(Path(spec.path)),
    peft_task_type="CAUSAL_LM",
    keeps_packed_documents_apart=True,  # transformers >= 4.47 masks packed documents apart by position ids
    enable_gradient_checkpointing=enable_hf_gradient_checkpointing,
    weights_format=HF_PRETRAINED,  # a full fine-tune loads with AutoModelForCausalLM.from_pretrained
    build_on_meta=build_hf_causal_lm_on_meta,
    checkpoint_problems=hf_checkpoint_problems,
    checkpointed_inputs=hf_checkpointed_inputs,
    whole_logits_bytes=hf_whole_logits_bytes,
    exports=frozenset({"gguf", "merged"}),  # jobs/checkpoints/gguf_file.py, export.py read save_pretrained dirs
    apply_kernels=apply_liger_kernels,  # training.kernels: liger (CUDA, with ferry[kernels])
)
