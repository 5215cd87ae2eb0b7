"""The DiT as a Ferry model: build, LoRA, loss, gradient checkpointing, and checkpoint files.

LoRA goes through diffusers' own ``add_adapter`` (peft underneath), as diffusers' dreambooth scripts do,
and is saved with the pipeline's ``save_lora_weights``: ``pytorch_lora_weights.safetensors`` with
``transformer.``-prefixed keys and the adapter's config as metadata, which ``pipeline.load_lora_weights``
reads. A full fine-tune writes ``transformer/`` (config.json + diffusion_pytorch_model.safetensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from jobs.models.diffusion.components import load_transformer
from jobs.models.diffusion.flow_match import flow_matching_loss, noisy_latents
from jobs.models.diffusion.modulation_table import feed_modulation
from jobs.models.diffusion.variants import FAMILIES, Conditioning, DiffusionFamily

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
TRANSFORMER_DIR = "transformer"
TRANSFORMER_WEIGHTS = "diffusion_pytorch_model.safetensors"


def build_dit(spec: Any, seed: int) -> nn.Module:
    """The pipeline's transformer on the CPU in ``model.dtype`` (random weights for ``init: random``)."""
    torch.manual_seed(seed)
    return load_transformer(Path(spec.path), spec.init, getattr(torch, spec.dtype), seed)


def family_of_model(model: nn.Module) -> DiffusionFamily:
    return FAMILIES[type(model).__name__]


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The DiT's own dtype (LoRA weights are float32; inputs follow the base weights)."""
    head: Any = model.proj_out  # a Linear, or peft's wrapper around one
    return getattr(head, "base_layer", head).weight.dtype


def flow_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The flow-matching loss of one micro-batch (flow_match.py has the objective and its weighting). A batch
    has ``prompt_mask`` only when a prompt in it is padded (batches.padded_mask), ``modulation`` when the
    DiT's modulation is precomputed (modulation_table.py), ``pooled_prompt_embeds`` for Flux.1 and
    ``guidance`` for a guidance-distilled DiT (Flux)."""
    dtype = compute_dtype(model)
    latents, noise, sigma = batch["latents"], batch["noise"], batch["sigma"]
    noisy = noisy_latents(latents, noise, sigma).to(dtype)
    feed_modulation(model, batch.get("modulation"))
    pooled = batch.get("pooled_prompt_embeds")
    cond = Conditioning(
        batch["prompt_embeds"].to(dtype),
        batch.get("prompt_mask"),
        pooled.to(dtype) if pooled is not None else None,
        batch.get("guidance"),
    )
    prediction = family_of_model(model).predict(model, noisy, sigma, cond)
    return flow_matching_loss(prediction, latents, noise, batch["weight"])


def apply_dit_lora(model: Any, lora: Any) -> nn.Module:
    """Freeze the DiT and add float32 LoRA adapters on ``lora.target_modules`` (diffusers' add_adapter)."""
    from peft import LoraConfig

    model.requires_grad_(False)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha or lora.rank,
        lora_dropout=lora.dropout,
        init_lora_weights="gaussian",  # as diffusers' dreambooth LoRA scripts
        target_modules=list(lora.target_modules),
    )
    model.add_adapter(config)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # adapters train in float32 on a bf16 base
    return model


def enable_dit_checkpointing(model: Any) -> None:
    """diffusers' own block checkpointing; the trainer swaps Ferry's checkpoint in (jobs/recompute/apply.py)."""
    model.enable_gradient_checkpointing()


def has_lora(model: nn.Module) -> bool:
    return bool(getattr(model, "peft_config", None))


def save_dit(model: Any, directory: Path) -> None:
    """LoRA in the diffusers pipeline format, or the whole transformer/ folder after a full fine-tune."""
    if has_lora(model):
        from peft import get_peft_model_state_dict

        pipeline = _pipeline_class(model)
        state = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}
        metadata = model.peft_config["default"].to_dict()
        metadata["target_modules"] = sorted(metadata["target_modules"])
        pipeline.save_lora_weights(
            str(directory), transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
        )
        return
    folder = directory / TRANSFORMER_DIR
    folder.mkdir()
    model.save_config(str(folder))
    # .to("cpu") copies weights the engine keeps on the device; at rest every parameter holds its value.
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / TRANSFORMER_WEIGHTS), metadata={"format": "pt"})


def load_dit(model: Any, directory: Path) -> None:
    """Load what `save_dit` wrote into a freshly built CPU model (before the engine attaches)."""
    if has_lora(model):
        from peft import set_peft_model_state_dict

        state = _pipeline_class(model).lora_state_dict(str(directory))
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        result: Any = set_peft_model_state_dict(model, state, adapter_name="default")
        if getattr(result, "unexpected_keys", None):
            raise ValueError(
                f"checkpoint {directory} has adapter weights this model lacks: {result.unexpected_keys[:5]}"
            )
        return
    model.load_state_dict(load_file(str(directory / TRANSFORMER_DIR / TRANSFORMER_WEIGHTS)), strict=True)


def _pipeline_class(model: nn.Module) -> Any:
    import diffusers

    return getattr(diffusers, family_of_model(model).pipeline_class)
