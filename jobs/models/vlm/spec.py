"""The ``model:`` and ``data:`` sections of vision-language jobs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from jobs.spec.sections import DataPath, Dtype, ModelPath, Section

QWEN_MAX_PIXELS = 1280 * 28 * 28  # Qwen2.5-VL's own default ceiling: 1280 tokens of 28x28 pixels an image


class HFImageTextToTextSpec(Section):
    """A Hugging Face image-text-to-text model (``AutoModelForImageTextToText``) and its processor from a local
    ``save_pretrained`` directory; no remote code. LoRA or full training reach the language model; the vision
    tower stays frozen unless ``train_vision_tower``."""

    kind: Literal["hf_image_text_to_text"]
    path: ModelPath
    dtype: Dtype = "bfloat16"
    init: Literal["checkpoint", "random"] = Field(
        "checkpoint", description="checkpoint: the safetensors in path; random: config.json only (benchmarking shapes)"
    )
    train_vision_tower: bool = Field(
        False,
        description="train the vision encoder's weights in full too (with LoRA: saved beside the adapter); "
        "false: frozen, as LLaMA-Factory's freeze_vision_tower and axolotl do by default",
    )


class ImageChatDataSpec(Section):
    """Chat rows with images: OpenAI's content parts (``{type: image_url, image_url: {url}}``, a path beside the
    data or a ``data:`` URL) or TRL's ``messages`` + ``images`` column; loss on assistant turns."""

    kind: Literal["image_chat"]
    path: DataPath = Field(description="a JSONL (or JSON, Parquet) file or a directory of them; images beside it")
    file_type: Literal["auto", "jsonl", "json", "parquet", "saved"] = "auto"
    messages_field: str = "messages"
    images_field: str = Field(
        "images", description="TRL's column of image paths, taken by {type: image} parts in order"
    )
    train_on_prompt: bool = False
    seq_len: int = Field(2048, gt=1, description="tokens a row may take, its images' tokens included")
    max_image_pixels: int = Field(
        QWEN_MAX_PIXELS,
        gt=0,
        description="an image with more pixels is resized down (aspect kept) before the processor sees it, with a "
        "note in the job's log; the processor's own limits (Qwen's max_pixels) apply after",
    )
    huge_images: Literal["resize", "refuse"] = Field(
        "resize", description="above max_image_pixels: resize (noted in the log) or refuse the row"
    )
    max_images_per_row: int = Field(
        10,
        gt=0,
        le=1024,
        description="a row with more images is refused, naming it (OpenAI's limit for vision fine-tuning); raise it "
        "for multi-image rows, whose images' tokens must fit seq_len too",
    )


class ImageSamplesSpec(Section):
    """Samples of an image-text job: the first ``rows`` rows of the data, their images shown with the prompt and
    the model's greedy answer, with each checkpoint (and so on the dashboard)."""

    rows: int = Field(2, gt=0, le=16, description="the first rows of data.path, each up to its last assistant turn")
    every_steps: int = Field(
        100, gt=0, le=1_000_000, description="sample (and checkpoint) every N steps, and at the end"
    )
    max_new_tokens: int = Field(32, gt=0, le=1024)
