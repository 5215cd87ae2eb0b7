"""The frozen encoders of a pipeline: prompts to embeddings, pixels to latents and back, under no_grad.

With ``offload.enable_model_cpu_offload`` the text encoder (7B for Qwen-Image, T5-XXL's 4.7B for Flux.1, 24B for
Flux.2) runs through the offload engine like the DiT, so it fits the same small card; the VAE (about 0.1B) and
Flux.1's CLIP-L (0.1B), whose pooled output the DiT takes, are moved to the device whole.
Everything returned is on the CPU: callers cache it or put it in a batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from jobs.models.diffusion.components import load_text_encoder, load_tokenizer, load_vae
from jobs.models.diffusion.variants import DiffusionFamily
from offload import OffloadTrainingManager


class Encoders:
    """Text encoder, tokenizer and VAE of one pipeline directory, placed on ``device``.

    Example:
        >>> encoders = Encoders.load(spec, device, with_text=True, with_vae=True)
        >>> embeds = encoders.encode_prompts(["a photo of a cat"])
        >>> encoders.close()
    """

    def __init__(
        self,
        family: DiffusionFamily,
        device: torch.device,
        text_encoder: Any,
        tokenizer: Any,
        vae: Any,
        pooled: tuple[Any, Any] | None = None,
    ) -> None:
        self.family, self.device = family, device
        self.text_encoder, self.tokenizer, self.vae = text_encoder, tokenizer, vae
        self.pooled = pooled  # (encoder, tokenizer) of Flux.1's CLIP-L, else None
        self.manager: OffloadTrainingManager | None = None

    @classmethod
    def load(cls, spec: Any, device: torch.device, *, with_text: bool, with_vae: bool) -> Encoders:
        """Load the parts a job needs; the text encoder goes through the engine under model offload."""
        from jobs.models.diffusion.variants import family_of

        model = spec.model
        family, path = family_of(model.path), Path(model.path)
        text_dtype = getattr(torch, model.text_encoder_dtype or model.dtype)
        seed = spec.training.seed
        encoder = load_text_encoder(path, family, model.init, text_dtype, seed) if with_text else None
        tokenizer = (
            load_tokenizer(path, family.tokenizer_folder, processor=family.tokenizer_is_processor)
            if with_text
            else None
        )
        vae = load_vae(path, family, model.init, getattr(torch, model.vae_dtype), seed) if with_vae else None
        pooled = None
        if with_text and family.pooled_encoder is not None:
            part = family.pooled_encoder
            clip = load_text_encoder(
                path, family, model.init, text_dtype, seed + 1, folder=part.folder, class_name=part.encoder_class
            )
            pooled = (clip.to(device), load_tokenizer(path, part.tokenizer_folder))
        encoders = cls(family, device, encoder, tokenizer, vae, pooled)
        if encoder is not None:
            if spec.offload.enable_model_cpu_offload:
                encoders.manager = OffloadTrainingManager(encoder, device, options=spec.offload.engine_options())
            else:
                encoder.to(device)
        if vae is not None:
            vae.to(device)
        return encoders

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], max_length: int | None = None) -> list[torch.Tensor]:
        """One ``[tokens, dim]`` embedding per prompt (CPU)."""
        length = max_length or self.family.max_sequence_length
        embeds = self.family.encode_prompts(self.text_encoder, self.tokenizer, prompts, self.device, length)
        if self.manager is not None:
            # The encoder only runs forward: this ends its step, as after_backward ends a training step (the
            # first one starts prefetching and applies gpu_memory_budget).
            self.manager.after_forward()
        return [e.to("cpu") for e in embeds]

    @torch.no_grad()
    def encode_pooled(self, prompts: list[str]) -> list[torch.Tensor] | None:
        """One pooled ``[dim]`` embedding per prompt (CPU) where the family has a pooled encoder, else None."""
        if self.pooled is None or self.family.pooled_encoder is None:
            return None
        encoder, tokenizer = self.pooled
        return [e.to("cpu") for e in self.family.pooled_encoder.encode(encoder, tokenizer, prompts, self.device)]

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[B, 3, F, H, W]`` in [-1, 1] to normalized latents ``[B, C, F', H/8, W/8]`` (CPU, float32).

        The posterior's mode, not a sample: the same image always gives the same latents, so a cache and
        on-the-fly encoding train identically.
        """
        latents = self.family.encode_latents(self.vae, pixels.to(self.device, self.vae.dtype))
        return latents.float().cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents to pixels ``[B, 3, F, H, W]`` in [-1, 1] (CPU, float32)."""
        pixels = self.family.decode_latents(self.vae, latents.to(self.device, self.vae.dtype))
        return pixels.float().clamp(-1, 1).cpu()

    def close(self) -> None:
        """Detach the engine and drop the parts, so their host and device memory can be freed."""
        if self.manager is not None:
            self.manager.remove(copy=False)  # the encoder is dropped next: no second copy of its weights
        self.text_encoder = self.tokenizer = self.vae = self.manager = self.pooled = None
