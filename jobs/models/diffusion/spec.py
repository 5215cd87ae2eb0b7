"""The spec sections of diffusion jobs: the DiT model, image/caption data, its cache, and samples.

Kept here rather than in jobs/spec/job.py so diffusion grows without touching the file every job kind shares:
the family's registry entry (family.py) contributes them, and jobs/spec/job.py assembles the job spec from the
registry. Paths are confined to the model and data roots like every other path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from jobs.spec.sections import DataPath, Dtype, ModelPath, Section, broken_rules, confined_path


class DiffusersTransformerSpec(Section):
    """A diffusion transformer (DiT) from a local diffusers pipeline directory.

    The directory holds ``transformer/`` (config.json + safetensors) and, for caching or on-the-fly
    encoding and for samples, ``text_encoder/``, ``tokenizer/`` and ``vae/`` (Flux.1 also ``text_encoder_2/`` and
    ``tokenizer_2/``). The family (Qwen-Image, Wan, Flux.1, Flux.2) follows from the class named in
    ``transformer/config.json``; nothing is imported by name.
    """

    kind: Literal["diffusers_transformer"]
    path: ModelPath = Field(description="a diffusers pipeline directory (with transformer/) under a model root")
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="random: the config's shapes with random weights (benchmarks; no weights read)"
    )
    dtype: Dtype = "bfloat16"
    text_encoder_dtype: Dtype | None = Field(None, description="default: dtype")
    vae_dtype: Dtype = Field("float32", description="the VAE encodes and decodes in this dtype")
    quantize: Literal["nf4", "int8"] | None = Field(
        None, description="store, stream and keep the DiT's frozen linear weights quantized (QLoRA); needs lora"
    )
    precompute_modulation: bool | None = Field(
        None,
        description="Qwen-Image: compute every block's timestep modulation (img_mod.1, txt_mod.1: a third of the "
        "DiT's weights) once per timestep into host memory, so model offload never streams those weights. Flux.1: "
        "compute every block's modulation (norm1.linear, norm1_context.linear, norm.linear) once per DiT call, so "
        "model offload streams those weights once a step, not again in the recomputation. Needs them and "
        "time_text_embed frozen (LoRA). Default: on for LoRA under model offload",
    )

    @model_validator(mode="after")
    def _check_pipeline_dir(self) -> DiffusersTransformerSpec:
        from jobs.models.diffusion.variants import family_problem

        problem = family_problem(self.path)
        if problem:
            raise broken_rules([("path", problem)])
        return self


class ImageCaptionDataSpec(Section):
    """Images (or videos) with captions: DiffSynth-Studio's layout (a folder and a metadata file) or, without a
    metadata file, kohya's caption folders (each image beside a ``.txt`` caption; ``<N>_<name>`` subfolders
    repeat N times).

    ``metadata.csv`` (or ``.json``, a list of objects) has an ``image`` (or ``video``) column of paths
    relative to the folder and a ``prompt`` column. Each image is resized to at most ``max_pixels`` keeping
    its aspect ratio, then center-cropped to sides divisible by 16; images of one shape form a bucket and a
    batch never mixes buckets.
    """

    kind: Literal["image_caption"]
    path: DataPath = Field(description="the dataset folder under a data root")
    metadata: str | None = Field(None, description="file inside path; default: metadata.csv or metadata.json")
    max_pixels: int = Field(1024 * 1024, gt=0, description="pixel budget per image (DiffSynth's --max_pixels)")
    repeat: int = Field(1, gt=0, description="serve the set this many times per epoch (--dataset_repeat)")
    num_frames: int = Field(1, gt=0, description="video frames per sample (Wan: 4k+1); 1 for images")
    max_sequence_length: int | None = Field(None, gt=0, description="prompt tokens; default: the family's")
    caption_extension: str = Field(
        ".txt",
        pattern=r"^\.[A-Za-z0-9_]+$",
        description="caption folders: the sidecar's suffix (image.png + image.txt)",
    )
    trigger_word: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="replaces [trigger] in each caption, or is put in front of it (ai-toolkit's trigger_word)",
    )
    caption_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="train this fraction of samples with the empty caption (kohya, ai-toolkit)"
    )

    @model_validator(mode="after")
    def _check_rows(self) -> ImageCaptionDataSpec:
        from jobs.models.diffusion.data.images import metadata_problems

        problems = metadata_problems(self)
        if problems:
            raise broken_rules(problems)
        return self


class DiffusionCacheDataSpec(Section):
    """Train from a cache that a ``task: cache`` job wrote: latents and prompt embeddings, no encoders."""

    kind: Literal["diffusion_cache"]
    path: DataPath = Field(description="the cache directory (its manifest.json) under a data root")
    repeat: int = Field(1, gt=0, description="serve the cache this many times per epoch")
    caption_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="train this fraction of samples with the empty caption (kohya, ai-toolkit)"
    )


class CacheSpec(Section):
    """Where a ``task: cache`` job writes (split training's first stage, DiffSynth's ``data_process``)."""

    path: Path = Field(description="a directory under a data root; created if missing, reused if complete")
    shard_samples: int = Field(64, gt=0, description="samples per safetensors shard")

    @field_validator("path")
    @classmethod
    def _confine_parent(cls, value: Any, info: ValidationInfo) -> Any:
        # The directory may not exist yet: then its parent must, inside a data root.
        path = Path(value)
        if path.exists() or (info.context or {}).get("roots") is None:
            return confined_path(value, info, "data")
        return confined_path(path.parent, info, "data") / path.name


class SampleSpec(Section):
    """Images generated from fixed prompts while training, stored with each checkpoint."""

    every_steps: int = Field(gt=0, description="generate (and checkpoint) every N optimizer steps, and at the end")
    prompts: list[str] = Field(min_length=1, max_length=16)
    num_inference_steps: int = Field(8, gt=0, le=100, description="Euler steps on the family's schedule")
    height: int = Field(512, gt=0, multiple_of=16)
    width: int = Field(512, gt=0, multiple_of=16)
    num_frames: int = Field(1, gt=0, description="video frames (Wan: 4k+1); each frame is one PNG")
    seed: int = 0
    guidance_scale: float = Field(
        1.0,
        ge=1.0,
        le=30.0,
        description="classifier-free guidance against negative_prompt (two DiT calls a step); 1 = off. "
        "Qwen-Image's pipeline uses 4 (true_cfg_scale), Wan's 5. Flux: the DiT's guidance input instead (one call "
        "a step; FluxPipeline's default 3.5, Flux2Pipeline's 4)",
    )
    negative_prompt: str = Field(" ", max_length=2000, description="the prompt guidance steers away from")


class TimestepRange(Section):
    """Train only on part of the noise schedule (DiffSynth's min/max_timestep_boundary), as fractions."""

    min: float = Field(0.0, ge=0, lt=1)
    max: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="after")
    def _check_order(self) -> TimestepRange:
        if self.min >= self.max:
            raise broken_rules([("min", f"must be below timestep_range.max ({self.max}); got {self.min}")])
        return self


if TYPE_CHECKING:
    from jobs.spec.job import JobSpec, TrainingSpec

    class DiffusionTrainingSpec(TrainingSpec):
        """``training:`` with the fields this family adds (its registry entry's ``training_fields``)."""

        timestep_range: TimestepRange
        timestep_weighting: Literal["bell", "none"]
        guidance: float | None

    class DiffusionJobSpec(JobSpec):
        """A job as this family's callbacks see it: its model section, and the sections it adds to every job."""

        model: DiffusersTransformerSpec
        data: ImageCaptionDataSpec | DiffusionCacheDataSpec  # type: ignore[assignment]  # kinds the registry adds
        training: DiffusionTrainingSpec
        cache: CacheSpec | None
        sample: SampleSpec | None
