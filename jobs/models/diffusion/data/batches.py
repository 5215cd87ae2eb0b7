"""Micro-batches for flow-matching training, from a cache or encoded on the fly.

Batch ``i`` is a pure function of (seed, i): which samples (a seeded shuffle into size buckets per
epoch), and the noise, sigmas, loss weights and caption dropouts drawn on the CPU from a generator seeded by
(seed, i). So a resumed job continues exactly, and offloaded and plain training see identical tensors.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from jobs.models.diffusion.data.images import Row, bucketed_batches, image_size, load_pixels, read_rows, target_size
from jobs.models.diffusion.flow_match import TrainingTimesteps
from jobs.models.diffusion.modulation_table import ModulationTable
from jobs.models.diffusion.variants import DiffusionFamily


class SampleSource(Protocol):
    """Per-sample latents and prompt embeddings (and Flux.1's pooled embedding), and each sample's latent shape
    (for bucketing). A source may also say how often a sample repeats (``repeats(index)``) and give the empty
    caption's embeddings (``empty_prompt()``, for caption dropout)."""

    def __len__(self) -> int: ...
    def latent_shape(self, index: int) -> tuple[int, ...]: ...
    def sample(self, index: int) -> tuple[torch.Tensor, ...]: ...


class OnTheFlySamples:
    """Encodes each sample when its batch is built: no cache, the encoders stay loaded for the whole job."""

    def __init__(self, data: Any, encoders: Any) -> None:
        self.rows: list[Row] = read_rows(data)
        self.data, self.encoders = data, encoders
        self.sizes = [target_size(*image_size(row), data.max_pixels) for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def latent_shape(self, index: int) -> tuple[int, ...]:
        w, h = self.sizes[index]
        return (h // 8, w // 8)  # only its equality matters: it picks the bucket

    def repeats(self, index: int) -> int:
        return self.rows[index].repeats

    def sample(self, index: int) -> tuple[torch.Tensor, ...]:
        return encode_row(self.rows[index], self.sizes[index], self.data, self.encoders)

    def empty_prompt(self) -> tuple[torch.Tensor, ...]:
        return encode_prompt("", self.data, self.encoders)


def encode_prompt(prompt: str, data: Any, encoders: Any) -> tuple[torch.Tensor, ...]:
    """A caption's (prompt embeddings ``[tokens, dim]``[, pooled ``[dim]``]), as the cache stores them."""
    embeds = encoders.encode_prompts([prompt], data.max_sequence_length)[0]
    pooled = encoders.encode_pooled([prompt])
    return (embeds,) if pooled is None else (embeds, pooled[0])


def encode_row(row: Row, size: tuple[int, int], data: Any, encoders: Any) -> tuple[torch.Tensor, ...]:
    """One row's (latents ``[C, F, h, w]``, prompt embeddings ``[tokens, dim]``[, pooled]), as the cache stores them."""
    pixels = load_pixels(row, size, data.num_frames).unsqueeze(0)
    latents = encoders.encode_pixels(pixels)[0]
    return (latents, *encode_prompt(row.prompt, data, encoders))


class DiffusionBatches:
    """The runner's BatchSource for diffusion: stacked latents, padded prompts, noise, sigma, weight."""

    tokens_per_sample: int | None = None

    def __init__(
        self,
        source: SampleSource,
        family: DiffusionFamily,
        timesteps: TrainingTimesteps,
        *,
        batch_size: int,
        seed: int,
        repeat: int = 1,
        modulation: ModulationTable | None = None,
        caption_dropout: float = 0.0,
        guidance: float | None = None,
    ) -> None:
        self.source, self.family, self.timesteps = source, family, timesteps
        self.modulation = modulation  # the DiT's precomputed modulation: each batch carries its rows
        self.batch_size, self.seed = batch_size, seed
        self.caption_dropout, self.guidance = caption_dropout, guidance
        self.empty = self._empty_prompt(source) if caption_dropout > 0 else None
        # Each sample once per folder repeat (a caption folder's N_name), the whole list data.repeat times.
        repeats = getattr(source, "repeats", lambda index: 1)
        self.members = [i for i in range(len(source)) for _ in range(repeats(i))] * repeat
        self.shapes = [source.latent_shape(i) for i in self.members]
        self._epoch: tuple[int, list[list[int]]] | None = None
        self.batches_per_epoch = len(self._batches(0))
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"no image size has training.batch_size={batch_size} samples ({len(self.shapes)} in all); "
                "lower the batch size or add images of a shared size"
            )

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, bucketed_batches(self.shapes, self.batch_size, self.seed, epoch))
        return self._epoch[1]

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """The ``index``-th micro-batch (CPU tensors), counting across epochs."""
        epoch, within = divmod(index, self.batches_per_epoch)
        members = [self.source.sample(self.members[i]) for i in self._batches(epoch)[within]]
        latents = torch.stack([m[0].float() for m in members])
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        noise = torch.randn(latents.shape, generator=generator)
        sigma, weight = self.timesteps.draw(generator, len(members), self.family.image_tokens(latents.shape))
        if self.empty is not None:  # drawn after the rest, so a job without dropout draws as before
            dropped = torch.rand(len(members), generator=generator) < self.caption_dropout
            members = [(m[0], *self.empty) if drop else m for m, drop in zip(members, dropped.tolist(), strict=True)]
        embeds, mask = pad_prompts([m[1] for m in members], self.family, self.max_length)
        batch = {"latents": latents, "noise": noise, "sigma": sigma, "weight": weight, "prompt_embeds": embeds}
        if len(members[0]) > 2:  # Flux.1's pooled CLIP embedding
            batch["pooled_prompt_embeds"] = torch.stack([m[2] for m in members])
        if self.guidance is not None:  # the guidance input of a guidance-distilled DiT
            batch["guidance"] = torch.full((len(members),), self.guidance, dtype=torch.float32)
        if padded_mask(mask) is not None:  # read here, on the CPU: on the device it would cost a sync a step
            batch["prompt_mask"] = mask
        if self.modulation is not None:  # looked up here, where sigma is on the CPU
            batch["modulation"] = self.modulation.rows_for(sigma)
        return batch

    @property
    def max_length(self) -> int:
        return self.family.max_sequence_length

    @staticmethod
    def _empty_prompt(source: SampleSource) -> tuple[torch.Tensor, ...]:
        empty = getattr(source, "empty_prompt", lambda: None)()
        if empty is None:
            raise ValueError(
                "data.caption_dropout needs the empty caption's embedding, which this cache lacks; re-run its cache job"
            )
        return tuple(empty)


def padded_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """``mask`` if some prompt in it is padded, else ``None``: QwenImagePipeline.encode_prompt drops a mask
    that is all ones, so its DiT attends without one. Training and the samples run the attention the pipeline
    runs: SDPA's flash kernel rather than a masked one, which is also the faster (bench/RESULTS.md)."""
    return None if bool(mask.all()) else mask


def pad_prompts(
    embeds: list[torch.Tensor], family: DiffusionFamily, max_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad prompt embeddings to one length (the batch's longest, or the full length for Wan) + a mask."""
    length = max_length if family.pad_prompts_to_max else max(e.shape[0] for e in embeds)
    out = embeds[0].new_zeros((len(embeds), length, embeds[0].shape[1]))
    mask = torch.zeros((len(embeds), length), dtype=torch.long)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e[:length]
        mask[i, : e.shape[0]] = 1
    return out, mask
