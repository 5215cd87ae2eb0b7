"""What differs between diffusion model families: classes, prompt encoding, the DiT's call, the schedule.

A family is recognised by the class ``transformer/config.json`` names (its ``_class_name``), looked up in
a closed table: a spec can select Qwen-Image, Wan, Flux.1 or Flux.2, never name code to import (Flux's parts live in
flux/). Latents travel between
the modules of jobs/models/diffusion in one layout, ``[batch, channels, frames, height, width]``, normalized
with the VAE's per-channel mean and std as the pipelines do; each family turns them into its DiT's input.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobs.models.diffusion.flux import latents as flux_latents
from jobs.models.diffusion.flux import prompts as flux_prompts

GuideFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]

# The prompt template Qwen-Image's pipeline wraps every prompt in; its first 34 tokens are dropped after encoding.
QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_DROP_TOKENS = 34


@dataclass(frozen=True)
class Conditioning:
    """What the DiT is conditioned on besides the noisy latents and sigma, on the DiT's device.

    Attributes:
        embeds: The prompts' embeddings ``[B, L, D]``.
        mask: ``[B, L]`` where a prompt is padded (Qwen-Image), else None.
        pooled: Flux.1's pooled CLIP embedding ``[B, D']``, else None.
        guidance: ``[B]`` float32, the guidance input of guidance-distilled DiTs (Flux), else None.
    """

    embeds: torch.Tensor
    mask: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    guidance: torch.Tensor | None = None


PredictFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]


def _mean_std(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


def _encode_mean_std(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's and Wan's VAEs: 5-D pixels to latents normalized by the config's per-channel mean and std."""
    mode = vae.encode(pixels).latent_dist.mode()
    mean, std = _mean_std(vae, mode)
    return (mode - mean) / std


def _decode_mean_std(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    mean, std = _mean_std(vae, latents)
    return vae.decode(latents * std + mean, return_dict=False)[0]


def _latent_shape_causal(vae: Any, frames: int, height: int, width: int) -> tuple[int, ...]:
    """A factor of 2 per stage in space, in time 2 per stage marked in ``temperal_downsample`` (4k + 1 frames)."""
    spatial, temporal = 2 ** len(vae.temperal_downsample), 2 ** sum(vae.temperal_downsample)
    return (vae.config.z_dim, (frames - 1) // temporal + 1, height // spatial, width // spatial)


@dataclass(frozen=True)
class PooledEncoder:
    """A second text encoder whose pooled output conditions the DiT (Flux.1's CLIP-L)."""

    folder: str
    tokenizer_folder: str
    encoder_class: str
    encode: Callable[..., list[torch.Tensor]]


@dataclass(frozen=True)
class DiffusionFamily:
    """One family of diffusion transformers and the pipeline parts that come with it.

    Attributes:
        name: ``qwen_image``, ``wan``, ``flux1`` or ``flux2``; also the name of its timestep schedule (flow_match.py).
        transformer_class / vae_class: diffusers class names; text_encoder_class: a transformers one.
        pipeline_class: the diffusers pipeline whose ``save_lora_weights`` / ``load_lora_weights`` we match.
        max_sequence_length: prompt tokens kept, as the pipeline's default.
        encode_prompts: ``(text_encoder, tokenizer, prompts, device, max_len) -> [tokens_i, dim]`` per prompt.
        predict: ``(dit, noisy latents, sigma [B], Conditioning) -> velocity``; the mask is ``None`` when no
            prompt is padded (batches.padded_mask).
        pad_prompts_to_max: Wan's DiT sees prompts zero-padded to the full length; Qwen-Image's a mask.
        guide: ``(velocity with the prompt, with the negative prompt, scale) -> velocity``: classifier-free
            guidance as the family's pipeline combines the two.
        text_encoder_folder / tokenizer_folder: where the sequence encoder lives (Flux.1: T5 in text_encoder_2/).
        tokenizer_is_processor: load the tokenizer folder with AutoProcessor (Flux.2's PixtralProcessor).
        pooled_encoder: Flux.1's CLIP-L, whose pooled output the DiT takes; None for the others.
        encode_latents / decode_latents: ``(vae, [B, 3, F, H, W] in [-1, 1]) -> normalized latents`` and back.
        latent_shape: ``(vae, frames, height, width) -> (C, F, h, w)`` of the latents that decode to that size.
        tokens_per_latent_pixel: image tokens per latent position (1/4 where the DiT packs 2 x 2 patches).
        embedded_guidance: the sample's guidance_scale is the DiT's guidance input (one call a step), not CFG.
        video: the family takes more than one frame.
    """

    name: str
    transformer_class: str
    vae_class: str
    text_encoder_class: str
    pipeline_class: str
    max_sequence_length: int
    encode_prompts: Callable[..., list[torch.Tensor]]
    predict: PredictFn
    pad_prompts_to_max: bool
    guide: GuideFn
    text_encoder_folder: str = "text_encoder"
    tokenizer_folder: str = "tokenizer"
    tokenizer_is_processor: bool = False
    pooled_encoder: PooledEncoder | None = None
    encode_latents: Callable[[Any, torch.Tensor], torch.Tensor] = _encode_mean_std
    decode_latents: Callable[[Any, torch.Tensor], torch.Tensor] = _decode_mean_std
    latent_shape: Callable[[Any, int, int, int], tuple[int, ...]] = _latent_shape_causal
    tokens_per_latent_pixel: float = 0.25
    embedded_guidance: bool = False
    video: bool = False

    def image_tokens(self, latent_shape: tuple[int, ...] | torch.Size) -> int:
        """The DiT's image tokens for one sample of latents ``[C, F, h, w]``."""
        _, frames, h, w = latent_shape[-4:]
        return int(frames * h * w * self.tokens_per_latent_pixel)


def _qwen_encode(encoder: nn.Module, tokenizer: Any, prompts: list[str], device: torch.device, max_len: int) -> list:
    """QwenImagePipeline._get_qwen_prompt_embeds: the last hidden state of the template-wrapped prompt."""
    tokens = tokenizer(
        [QWEN_TEMPLATE.format(p) for p in prompts],
        max_length=max_len + QWEN_DROP_TOKENS,
        padding=True,
        truncation=True,
        return_tensors="pt",
    ).to(device)
    hidden = encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True)
    last = hidden.hidden_states[-1]
    return [h[m.bool()][QWEN_DROP_TOKENS:] for h, m in zip(last, tokens.attention_mask, strict=True)]


def _wan_encode(encoder: nn.Module, tokenizer: Any, prompts: list[str], device: torch.device, max_len: int) -> list:
    """WanPipeline._get_t5_prompt_embeds: umT5's last hidden state over the prompt's own tokens."""
    tokens = tokenizer(
        [" ".join(p.split()) for p in prompts],
        padding="max_length",
        max_length=max_len,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    ).to(device)
    last = encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state
    lengths = tokens.attention_mask.gt(0).sum(dim=1).tolist()
    return [h[:n] for h, n in zip(last, lengths, strict=True)]


def _qwen_pack(latents: torch.Tensor) -> torch.Tensor:
    """``[b, c, 1, h, w]`` latents as Qwen-Image's tokens of 2x2 patches (QwenImagePipeline._pack_latents)."""
    b, c, _, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def _qwen_unpack(tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    b, c, _, h, w = shape
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, 1, h, w)


def _qwen_predict(dit: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """Pack 2x2 latent patches into tokens, predict, unpack."""
    b, _, f, h, w = latents.shape
    if f != 1:
        raise ValueError(f"Qwen-Image trains on images (1 frame); got latents of {f} frames (data.num_frames)")
    tokens = _qwen_pack(latents)
    out = dit(
        hidden_states=tokens,
        timestep=sigma.to(tokens.dtype),  # the pipeline passes t / 1000, which is sigma
        encoder_hidden_states=cond.embeds,
        encoder_hidden_states_mask=cond.mask,
        img_shapes=[[(1, h // 2, w // 2)]] * b,
        return_dict=False,
    )[0]
    return _qwen_unpack(out, latents.shape)


def _qwen_guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's true CFG: the guided velocity rescaled, token by token, to the norm of the one
    with the prompt."""
    cond_tokens, uncond_tokens = _qwen_pack(cond), _qwen_pack(uncond)
    combined = uncond_tokens + scale * (cond_tokens - uncond_tokens)
    rescaled = combined * (cond_tokens.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    return _qwen_unpack(rescaled, cond.shape)


def _wan_guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """WanPipeline's classifier-free guidance."""
    return uncond + scale * (cond - uncond)


def _wan_predict(dit: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """Wan's DiT takes the 5-D latents and the timestep on the 0-1000 scale; padding tokens are zeros (the
    pipeline passes zero-padded embeddings and no mask)."""
    return dit(hidden_states=latents, timestep=sigma * 1000, encoder_hidden_states=cond.embeds, return_dict=False)[0]


FAMILIES: dict[str, DiffusionFamily] = {
    "QwenImageTransformer2DModel": DiffusionFamily(
        name="qwen_image",
        transformer_class="QwenImageTransformer2DModel",
        vae_class="AutoencoderKLQwenImage",
        text_encoder_class="Qwen2_5_VLForConditionalGeneration",
        pipeline_class="QwenImagePipeline",
        max_sequence_length=1024,
        encode_prompts=_qwen_encode,
        predict=_qwen_predict,
        pad_prompts_to_max=False,
        guide=_qwen_guide,
    ),
    "WanTransformer3DModel": DiffusionFamily(
        name="wan",
        transformer_class="WanTransformer3DModel",
        vae_class="AutoencoderKLWan",
        text_encoder_class="UMT5EncoderModel",
        pipeline_class="WanPipeline",
        max_sequence_length=512,
        encode_prompts=_wan_encode,
        predict=_wan_predict,
        pad_prompts_to_max=True,
        guide=_wan_guide,
        video=True,
    ),
    "FluxTransformer2DModel": DiffusionFamily(
        name="flux1",
        transformer_class="FluxTransformer2DModel",
        vae_class="AutoencoderKL",
        text_encoder_class="T5EncoderModel",
        pipeline_class="FluxPipeline",
        max_sequence_length=512,
        encode_prompts=flux_prompts.flux1_encode,
        predict=flux_latents.flux1_predict,
        pad_prompts_to_max=False,  # every prompt is max_sequence_length tokens already, padding included
        guide=_wan_guide,  # unused: the guidance is the DiT's input (embedded_guidance)
        text_encoder_folder="text_encoder_2",
        tokenizer_folder="tokenizer_2",
        pooled_encoder=PooledEncoder("text_encoder", "tokenizer", "CLIPTextModel", flux_prompts.flux1_pooled),
        encode_latents=flux_latents.flux1_encode_latents,
        decode_latents=flux_latents.flux1_decode_latents,
        latent_shape=flux_latents.flux1_latent_shape,
        embedded_guidance=True,
    ),
    "Flux2Transformer2DModel": DiffusionFamily(
        name="flux2",
        transformer_class="Flux2Transformer2DModel",
        vae_class="AutoencoderKLFlux2",
        text_encoder_class="Mistral3ForConditionalGeneration",
        pipeline_class="Flux2Pipeline",
        max_sequence_length=512,
        encode_prompts=flux_prompts.flux2_encode,
        predict=flux_latents.flux2_predict,
        pad_prompts_to_max=False,
        guide=_wan_guide,  # unused: the guidance is the DiT's input (embedded_guidance)
        tokenizer_is_processor=True,
        encode_latents=flux_latents.flux2_encode_latents,
        decode_latents=flux_latents.flux2_decode_latents,
        latent_shape=flux_latents.flux2_latent_shape,
        tokens_per_latent_pixel=1.0,  # latents are patchified already: one token per position
        embedded_guidance=True,
    ),
}


def transformer_config(path: Path) -> dict[str, Any]:
    """``transformer/config.json`` of a pipeline directory."""
    return json.loads((Path(path) / "transformer" / "config.json").read_text())


def family_problem(path: Path) -> str | None:
    """Why ``path`` is not a pipeline directory Ferry can train, or None when it is."""
    config_file = Path(path) / "transformer" / "config.json"
    if not (Path(path) / "transformer").is_dir():
        return f"{path} has no transformer/ folder; give a diffusers pipeline directory (transformer/, vae/, ...)"
    try:
        name = json.loads(config_file.read_text()).get("_class_name")
    except (OSError, ValueError) as exc:
        return f"cannot read {config_file}: {exc}"
    if name not in FAMILIES:
        return f"transformer/config.json names class {name!r}; supported: {', '.join(FAMILIES)}"
    if importlib.util.find_spec("diffusers") is None:
        return "model.kind diffusers_transformer needs the diffusers package: pip install 'ferry[diffusion]'"
    return None


def family_of(path: Path) -> DiffusionFamily:
    """The family of the pipeline directory ``path`` (checked at submit by `family_problem`)."""
    return FAMILIES[transformer_config(path)["_class_name"]]
