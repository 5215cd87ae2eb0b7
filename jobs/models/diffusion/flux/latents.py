"""Latents and the DiT's call for Flux.1 and Flux.2, as FluxPipeline and Flux2Pipeline (and diffusers' Flux
DreamBooth scripts) build them.

Latents travel in jobs/models/diffusion's layout ``[batch, channels, frames=1, h, w]``, normalized:

- Flux.1 (``AutoencoderKL``): ``(z - shift_factor) * scaling_factor``; the DiT sees 2 x 2 patches packed into
  tokens (``FluxPipeline._pack_latents``), position ids ``(0, row, column)`` per token and zeros for the text.
- Flux.2 (``AutoencoderKLFlux2``): the VAE's latents patchified 2 x 2 into channels first
  (``Flux2Pipeline._patchify_latents``), then normalized by the VAE's batch-norm statistics; so a latent here
  is ``[4 C, 1, h / 2, w / 2]``, one token per position, with ids ``(t, row, column, l)``.

Both DiTs take ``timestep = sigma`` (the pipelines pass ``t / 1000``) in the latents' dtype and a guidance value
for guidance-distilled weights (``guidance_embeds``); the DiT multiplies both by 1000.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from jobs.models.diffusion.variants import Conditioning


def _spatial_factor(vae: Any) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


# ---- Flux.1 -------------------------------------------------------------------------------------------
def flux1_encode_latents(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 3, 1, H, W]`` to normalized ``[B, C, 1, H/8, W/8]``: the posterior's mode, shifted and scaled."""
    z = vae.encode(pixels[:, :, 0]).latent_dist.mode()
    return ((z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor).unsqueeze(2)


def flux1_decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    z = latents[:, :, 0] / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    return vae.decode(z, return_dict=False)[0].unsqueeze(2)


def flux1_latent_shape(vae: Any, frames: int, height: int, width: int) -> tuple[int, ...]:
    del frames  # images only
    factor = _spatial_factor(vae)
    return (vae.config.latent_channels, 1, height // factor, width // factor)


def flux1_pack(latents: torch.Tensor) -> torch.Tensor:
    """``[b, c, 1, h, w]`` to ``[b, h/2 * w/2, 4 c]`` (FluxPipeline._pack_latents)."""
    b, c, _, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def flux1_unpack(tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    b, c, _, h, w = shape
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, 1, h, w)


def flux1_image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """FluxPipeline._prepare_latent_image_ids for a ``h x w`` grid of tokens: ``[h w, 3]``."""
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] += torch.arange(h, device=device)[:, None]
    ids[..., 2] += torch.arange(w, device=device)[None, :]
    return ids.reshape(h * w, 3).to(dtype)


def flux1_predict(dit: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """Pack, predict with the pooled CLIP embedding and (for guidance-distilled weights) the guidance, unpack."""
    _, _, f, h, w = latents.shape
    if f != 1:
        raise ValueError(f"Flux trains on images (1 frame); got latents of {f} frames (data.num_frames)")
    tokens = flux1_pack(latents)
    config: Any = dit.config
    out = dit(
        hidden_states=tokens,
        timestep=sigma.to(tokens.dtype),
        guidance=cond.guidance if config.guidance_embeds else None,
        pooled_projections=cond.pooled,
        encoder_hidden_states=cond.embeds,
        txt_ids=torch.zeros(cond.embeds.shape[1], 3, device=tokens.device, dtype=tokens.dtype),
        img_ids=flux1_image_ids(h // 2, w // 2, tokens.device, tokens.dtype),
        return_dict=False,
    )[0]
    return flux1_unpack(out, latents.shape)


# ---- Flux.2 -------------------------------------------------------------------------------------------
def _bn_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


def flux2_encode_latents(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 3, 1, H, W]`` to ``[B, 4 C, 1, H/16, W/16]``: the mode, patchified, batch-norm normalized."""
    from diffusers import Flux2Pipeline

    z = Flux2Pipeline._patchify_latents(vae.encode(pixels[:, :, 0]).latent_dist.mode())
    mean, std = _bn_stats(vae, z)
    return ((z - mean) / std).unsqueeze(2)


def flux2_decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    from diffusers import Flux2Pipeline

    x = latents[:, :, 0]
    mean, std = _bn_stats(vae, x)
    return vae.decode(Flux2Pipeline._unpatchify_latents(x * std + mean), return_dict=False)[0].unsqueeze(2)


def flux2_latent_shape(vae: Any, frames: int, height: int, width: int) -> tuple[int, ...]:
    del frames  # images only
    factor = 2 * _spatial_factor(vae)
    return (4 * vae.config.latent_channels, 1, height // factor, width // factor)


def flux2_predict(dit: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """One token per (patchified) latent position, ids ``(0, row, column, 0)``, text ids ``(0, 0, 0, l)``."""
    b, c, f, h, w = latents.shape
    if f != 1:
        raise ValueError(f"Flux trains on images (1 frame); got latents of {f} frames (data.num_frames)")
    device = latents.device
    tokens = latents.reshape(b, c, h * w).permute(0, 2, 1)  # Flux2Pipeline._pack_latents
    zero = torch.arange(1, device=device)
    image_ids = torch.cartesian_prod(zero, torch.arange(h, device=device), torch.arange(w, device=device), zero)
    text_ids = torch.cartesian_prod(zero, zero, zero, torch.arange(cond.embeds.shape[1], device=device))
    out = dit(
        hidden_states=tokens,
        timestep=sigma.to(tokens.dtype),
        guidance=cond.guidance,
        encoder_hidden_states=cond.embeds,
        txt_ids=text_ids.unsqueeze(0).expand(b, -1, -1),
        img_ids=image_ids.unsqueeze(0).expand(b, -1, -1),
        return_dict=False,
    )[0]
    return out[:, : h * w].permute(0, 2, 1).reshape(b, c, 1, h, w)
