"""Samples while training: fixed prompts, fixed seed, a few Euler steps with the current (offloaded) DiT.

The prompts (and, with ``guidance_scale`` above 1, the negative prompt) are encoded once when the job starts;
each Euler step then calls the DiT with the prompt and with the negative prompt and combines the two as the
family's pipeline does (variants.py ``guide``). Flux's DiTs are guidance-distilled: ``guidance_scale`` is their
guidance input, one call a step, on the pipeline's schedule for the image's size. The VAE decodes the latents. Each prompt gives one PNG
(one per frame for video), named ``sample-<prompt>.png`` or ``sample-<prompt>-f<frame>.png``, written
into the checkpoint directory of the same step, so samples are checkpoint artifacts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobs.models.diffusion.data.batches import pad_prompts, padded_mask
from jobs.models.diffusion.flow_match import euler_sample
from jobs.models.diffusion.model import compute_dtype, family_of_model
from jobs.models.diffusion.modulation_table import modulation_table
from jobs.models.diffusion.variants import Conditioning


class Sampler:
    """Generates the ``sample`` section's images with a DiT; owns the prompt embeddings and the VAE."""

    def __init__(
        self,
        sample_spec: Any,
        prompt_embeds: list[torch.Tensor],
        encoders: Any,
        negative_embeds: torch.Tensor | None = None,
        pooled_embeds: list[torch.Tensor] | None = None,
    ) -> None:
        self.spec, self.prompt_embeds, self.encoders = sample_spec, prompt_embeds, encoders
        self.every_steps: int = sample_spec.every_steps
        self.prompts: list[str] = list(sample_spec.prompts)
        self.negative_embeds = negative_embeds  # None: no classifier-free guidance (guidance_scale 1, or Flux)
        self.pooled_embeds = pooled_embeds  # Flux.1's pooled CLIP embedding per prompt

    def write(self, model: nn.Module, directory: Path) -> list[str]:
        """Generate with ``model`` and write the PNGs into ``directory`` (a checkpoint being written)."""
        return write_pngs(self.generate(model, self.encoders.device), directory)

    def close(self) -> None:
        self.encoders.close()

    def latent_shape(self) -> tuple[int, ...]:
        """The latents that decode to the sample's size, from the VAE's own down-sampling (a factor of 8 in the
        released models) as the family lays latents out."""
        spec = self.spec
        return self.encoders.family.latent_shape(self.encoders.vae, spec.num_frames, spec.height, spec.width)

    @torch.no_grad()
    def generate(self, model: nn.Module, device: torch.device) -> list[torch.Tensor]:
        """One ``[3, F, H, W]`` image tensor in [-1, 1] per prompt (CPU). ``model`` is left as it was found."""
        family = family_of_model(model)
        dtype = compute_dtype(model)
        was_training = model.training
        model.eval()
        try:
            images = []
            negative = self._padded(self.negative_embeds, family, device, dtype)  # the same for every prompt
            table = modulation_table(model)  # a precomputed modulation: each Euler step feeds its rows
            guidance = torch.full((1,), self.spec.guidance_scale, device=device) if family.embedded_guidance else None
            for index, embeds in enumerate(self.prompt_embeds):
                # Each prompt's noise from its own generator: adding a prompt does not change the others.
                generator = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + index)
                noise = torch.randn((1, *self.latent_shape()), generator=generator).to(device)
                prompt = self._padded(embeds, family, device, dtype)
                assert prompt is not None
                pooled = self.pooled_embeds[index][None].to(device, dtype) if self.pooled_embeds else None
                prompt = Conditioning(prompt.embeds, prompt.mask, pooled, guidance)

                def velocity(x: torch.Tensor, sigma: torch.Tensor, prompt: Conditioning = prompt) -> torch.Tensor:
                    x = x.to(dtype)
                    if table is not None:  # looked up on the CPU: one sync per Euler step, samples only
                        table.feed(table.rows_for(sigma).to(device))
                    cond = family.predict(model, x, sigma, prompt).float()
                    if negative is None:
                        return cond
                    uncond = family.predict(model, x, sigma, negative).float()
                    return family.guide(cond, uncond, self.spec.guidance_scale)

                tokens = family.image_tokens(noise.shape)
                latents = euler_sample(velocity, noise, family.name, self.spec.num_inference_steps, tokens)
                images.append(self.encoders.decode(latents)[0])
            return images
        finally:
            model.train(was_training)

    @staticmethod
    def _padded(
        embeds: torch.Tensor | None, family: Any, device: torch.device, dtype: torch.dtype
    ) -> Conditioning | None:
        """One prompt's embeddings as the DiT takes them (padded, with the mask if padded), on ``device``."""
        if embeds is None:
            return None
        padded, mask = pad_prompts([embeds], family, family.max_sequence_length)
        kept = padded_mask(mask)
        return Conditioning(padded.to(device, dtype), kept.to(device) if kept is not None else None)


def write_pngs(images: list[torch.Tensor], directory: Path) -> list[str]:
    """Save each ``[3, F, H, W]`` tensor as PNG(s) in ``directory``; returns the file names."""
    from PIL import Image

    names = []
    for index, image in enumerate(images):
        frames = image.shape[1]
        for frame in range(frames):
            pixels = ((image[:, frame] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
            name = f"sample-{index:02d}.png" if frames == 1 else f"sample-{index:02d}-f{frame:03d}.png"
            Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy()).save(directory / name)
            names.append(name)
    return names
