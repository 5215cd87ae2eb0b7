"""``model.kind: diffusers_transformer``: Qwen-Image, Wan, Flux.1 and Flux.2 DiTs trained with flow matching.

The registry entry; the pieces live in jobs/models/diffusion/ (families, flow matching, data, the encoder cache,
samples). Data is either ``image_caption`` (encoded on the fly by the pipeline's own encoders) or
``diffusion_cache`` (written once by a ``task: cache`` job, DiffSynth-Studio's split training).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from accelerate import init_empty_weights
from pydantic import Field
from torch import nn

from jobs.checkpoints.weights import WeightsFormat
from jobs.errors import Problem
from jobs.models.diffusion.model import (
    apply_dit_lora,
    build_dit,
    enable_dit_checkpointing,
    flow_loss,
    load_dit,
    save_dit,
)
from jobs.models.diffusion.precompute import (
    check_precompute_modulation,
    drop_precomputed_modulation,
    install_precomputed_modulation,
)
from jobs.models.diffusion.spec import (
    CacheSpec,
    DiffusersTransformerSpec,
    DiffusionCacheDataSpec,
    ImageCaptionDataSpec,
    SampleSpec,
    TimestepRange,
)
from jobs.models.diffusion.variants import family_of as pipeline_family
from jobs.models.family import ModelFamily, activation_element_size, linear_module_names

if TYPE_CHECKING:
    from jobs.models.diffusion.spec import DiffusionJobSpec
    from jobs.spec.job import JobSpec

log = logging.getLogger(__name__)
_PROMPT_TOKENS_GUESS = 256  # the fit check's prompt length when no cache says better
FLUX_TRAIN_GUIDANCE = 3.5  # the guidance input diffusers' and kohya's Flux LoRA scripts train with


def meta_dit(spec: DiffusersTransformerSpec) -> nn.Module:
    """The DiT's shapes on the meta device, from transformer/config.json alone."""
    import diffusers

    cls = getattr(diffusers, pipeline_family(spec.path).transformer_class)
    with init_empty_weights(include_buffers=True):
        return cls.from_config(cls.load_config(str(Path(spec.path) / "transformer")))


def dit_activation_bytes(spec: DiffusionJobSpec, model: nn.Module) -> int:
    """Tokens x width per block, for an MMDiT block (attention, modulation, an MLP four times as wide on both streams).

    Image tokens: ``max_pixels / 256`` (the VAE's factor of 8, patches of 2 by 2; frames multiply). With gradient checkpointing
    each block keeps its two inputs, and one block's internals (about 14 h + 2 ffn per token) exist at once.
    """
    from jobs.models.diffusion.data.cache import read_manifest

    e = activation_element_size(spec)
    config: Any = model.config
    h = config.num_attention_heads * config.attention_head_dim
    layers = config.num_layers + getattr(config, "num_single_layers", 0)  # Flux: double and single blocks
    image_tokens, prompt_tokens = _token_counts(spec, read_manifest)
    n = spec.training.batch_size * (image_tokens + prompt_tokens)
    block = n * (14 * h + 2 * 4 * h) * e
    if spec.training.gradient_checkpointing:
        return layers * n * h * e + 2 * block
    return layers * block + block


def _token_counts(spec: DiffusionJobSpec, read_manifest: Any) -> tuple[int, int]:
    data: Any = spec.data  # image_caption or diffusion_cache (data_kinds)
    family = pipeline_family(spec.model.path)
    if data.kind == "diffusion_cache":
        manifest = read_manifest(data.path) or {"shards": []}
        rows = [r for s in manifest["shards"] for r in s["rows"]] or [
            {"latents_shape": [1, 1, 64, 64], "prompt_tokens": 1}
        ]
        image = max(family.image_tokens(tuple(r["latents_shape"])) for r in rows)
        return image, max(r["prompt_tokens"] for r in rows)
    frames = (data.num_frames - 1) // 4 + 1
    prompt = data.max_sequence_length or (family.max_sequence_length if family.embedded_guidance else None)
    return frames * data.max_pixels // 256, prompt or _PROMPT_TOKENS_GUESS


def build_diffusion_data(spec: DiffusionJobSpec, device: torch.device, model: nn.Module) -> Any:
    """Batches from the cache, or from the images with the encoders loaded for the whole job; each batch
    carries its rows of the DiT's modulation table when the job uses one (`uses_precomputed_modulation`)."""
    from jobs.models.diffusion.data.batches import DiffusionBatches, OnTheFlySamples, SampleSource
    from jobs.models.diffusion.data.cache import CachedSamples
    from jobs.models.diffusion.encode import Encoders
    from jobs.models.diffusion.flow_match import TrainingTimesteps

    family = pipeline_family(spec.model.path)
    window = spec.training.timestep_range
    timesteps = TrainingTimesteps(family.name, (window.min, window.max), spec.training.timestep_weighting)
    data: Any = spec.data  # image_caption or diffusion_cache (data_kinds)
    source: SampleSource
    if data.kind == "diffusion_cache":
        source = CachedSamples(data.path)
    else:
        source = OnTheFlySamples(data, Encoders.load(spec, device, with_text=True, with_vae=True))
    modulation = install_precomputed_modulation(spec, model, timesteps, device)
    return DiffusionBatches(
        source,
        family,
        timesteps,
        batch_size=spec.training.batch_size,
        seed=spec.training.seed,
        repeat=data.repeat,
        modulation=modulation,
        caption_dropout=data.caption_dropout,
        guidance=training_guidance(spec),
    )


def training_guidance(spec: DiffusionJobSpec) -> float | None:
    """The guidance input training gives a guidance-distilled DiT (``guidance_embeds`` in its config), else None."""
    from jobs.models.diffusion.variants import transformer_config

    if not transformer_config(spec.model.path).get("guidance_embeds"):
        return None
    return spec.training.guidance if spec.training.guidance is not None else FLUX_TRAIN_GUIDANCE


def make_sampler(spec: DiffusionJobSpec, device: torch.device) -> Any:
    """The sample section's sampler: prompts encoded now (then the text encoder is dropped), the VAE kept."""
    if spec.sample is None:
        return None
    from jobs.models.diffusion.encode import Encoders
    from jobs.models.diffusion.samples import Sampler

    encoders = Encoders.load(spec, device, with_text=True, with_vae=True)
    # Classifier-free guidance needs the negative prompt; Flux's guidance is the DiT's own input instead.
    guided = spec.sample.guidance_scale > 1 and not encoders.family.embedded_guidance
    prompts = [*spec.sample.prompts, *([spec.sample.negative_prompt] if guided else [])]
    embeds = encoders.encode_prompts(prompts)
    pooled = encoders.encode_pooled(list(spec.sample.prompts))
    if encoders.manager is not None:
        encoders.manager.remove(copy=False)  # the text encoder is dropped next: no second copy of it
    encoders.text_encoder = encoders.tokenizer = encoders.manager = encoders.pooled = None
    negative = embeds.pop() if guided else None
    return Sampler(spec.sample, embeds, encoders, negative_embeds=negative, pooled_embeds=pooled)


def run_cache_task(spec: DiffusionJobSpec, **kwargs: Any) -> tuple[Literal["succeeded", "paused", "cancelled"], int]:
    from jobs.models.diffusion.cache_task import run_cache_job

    return run_cache_job(spec, **kwargs)


# ---- submit-time rules -------------------------------------------------------------------------------
def _check_cache_section(spec: JobSpec, family: ModelFamily[Any]) -> list[Problem]:
    # Runs for every job (section_rules): a job of any family may give the section.
    cache = getattr(spec, "cache", None)
    if spec.task == "cache" and cache is None:
        return [("cache", "task: cache needs a cache section: cache: {path: <directory under a data root>}")]
    if spec.task != "cache" and cache is not None:
        return [("cache", "only task: cache writes a cache; to train from one use data.kind: diffusion_cache")]
    return []


def _check_sample_section(spec: JobSpec, family: ModelFamily[Any]) -> list[Problem]:
    # Runs for every job (section_rules): ``family`` (the job's) must be one that writes samples.
    if getattr(spec, "sample", None) is not None and family.make_sampler is None:
        return [("sample", f"model.kind={spec.model.kind} does not generate samples; remove the section")]
    return []


def _check_cache_task(spec: DiffusionJobSpec) -> list[Problem]:
    if spec.task != "cache" or spec.cache is None:  # no cache section: rules.py names it
        return []
    if spec.data.kind != "image_caption":
        return [("data.kind", f"task: cache encodes data.kind=image_caption; got {spec.data.kind}")]
    from jobs.models.diffusion.cache_task import cache_target_problems

    return cache_target_problems(spec)


def _check_cache_data(spec: DiffusionJobSpec) -> list[Problem]:
    if spec.data.kind != "diffusion_cache":
        return []
    from jobs.models.diffusion.data.cache import cache_problems_for_training

    problems = cache_problems_for_training(spec.data.path, spec.model, spec.data.caption_dropout)
    return [("data.path", message) for message in problems]


def _check_encoders_present(spec: DiffusionJobSpec) -> list[Problem]:
    needs = spec.task == "cache" or spec.data.kind == "image_caption" or spec.sample is not None
    family = pipeline_family(spec.model.path)
    parts = [family.text_encoder_folder, family.tokenizer_folder, "vae"]
    if family.pooled_encoder is not None:
        parts = [family.pooled_encoder.folder, family.pooled_encoder.tokenizer_folder, *parts]
    missing = [part for part in sorted(parts) if not (Path(spec.model.path) / part).is_dir()]
    if needs and missing:
        why = (
            "task: cache"
            if spec.task == "cache"
            else ("data.kind: image_caption" if spec.data.kind == "image_caption" else "sample")
        )
        return [
            (
                "model.path",
                f"{why} needs the pipeline's encoders, but {spec.model.path} lacks {', '.join(m + '/' for m in missing)}",
            )
        ]
    return []


_FAMILY_NAMES = {"qwen_image": "Qwen-Image", "flux1": "Flux.1", "flux2": "Flux.2"}


def _check_frames(spec: DiffusionJobSpec) -> list[Problem]:
    family = pipeline_family(spec.model.path)
    if family.video:
        return []
    name = _FAMILY_NAMES.get(family.name, family.name)
    problems = []
    if spec.data.kind == "image_caption" and spec.data.num_frames != 1:
        problems.append(("data.num_frames", f"{name} trains on images; set it to 1 (got {spec.data.num_frames})"))
    if spec.sample is not None and spec.sample.num_frames != 1:
        problems.append(("sample.num_frames", f"{name} makes images; set it to 1 (got {spec.sample.num_frames})"))
    return problems


def _check_guidance(spec: DiffusionJobSpec) -> list[Problem]:
    from jobs.models.diffusion.variants import transformer_config

    if spec.training.guidance is None or transformer_config(spec.model.path).get("guidance_embeds"):
        return []
    return [
        (
            "training.guidance",
            "this DiT has no guidance embedding (guidance_embeds is not set in transformer/config.json); remove it",
        )
    ]


FAMILY = ModelFamily(
    kind="diffusers_transformer",
    spec=DiffusersTransformerSpec,
    build=build_dit,
    loss=flow_loss,
    data_kinds=("image_caption", "diffusion_cache"),
    meta_model=meta_dit,
    activation_bytes=dit_activation_bytes,
    lora_target_names=lambda spec: linear_module_names(meta_dit(spec)),
    enable_gradient_checkpointing=enable_dit_checkpointing,
    weights_format=WeightsFormat("diffusers", save_dit, load_dit),
    rules=(
        _check_cache_task,
        _check_cache_data,
        _check_encoders_present,
        _check_frames,
        check_precompute_modulation,
        _check_guidance,
    ),
    shrink_hint="data.max_pixels",
    apply_lora=apply_dit_lora,
    build_data=build_diffusion_data,
    drop_precomputed=drop_precomputed_modulation,
    make_sampler=make_sampler,
    tasks={"cache": run_cache_task},
    task_help={"cache": "encode data.kind image_caption once"},
    data_specs=(ImageCaptionDataSpec, DiffusionCacheDataSpec),
    job_sections={
        "cache": (CacheSpec | None, Field(None, description="where task: cache writes")),
        "sample": (SampleSpec | None, Field(None, description="images from fixed prompts with each checkpoint")),
    },
    # Flow matching (flow_match.py documents both).
    training_fields={
        "timestep_range": (
            TimestepRange,
            Field(TimestepRange(), description="part of the noise schedule to train on"),
        ),
        "timestep_weighting": (Literal["bell", "none"], Field("bell", description="loss weight per timestep")),
        "guidance": (
            float | None,
            Field(
                None,
                ge=0.0,
                le=30.0,
                description="the guidance input of a guidance-distilled DiT (Flux.1-dev, Flux.2-dev) while training; "
                "default 3.5, as diffusers' and kohya's Flux scripts",
            ),
        ),
    },
    section_rules=(_check_cache_section, _check_sample_section),
)
