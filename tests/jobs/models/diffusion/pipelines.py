"""Tiny random diffusers pipelines saved to a directory, and tiny image datasets, for the diffusion tests.

Shapes follow diffusers' own pipeline tests (tiny configs of the real classes); the tokenizer is a
byte-level BPE without merges built with `tokenizers`, so nothing is downloaded.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

Z_DIM = 4


def byte_tokenizer(pad: str = "<pad>") -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad, eos_token="<eos>")
    return fast


def qwen_image_pipeline(
    directory: Path, *, layers: int = 2, attention_head_dim: int = 16, max_shard_size: str | None = None
) -> Path:
    """A QwenImagePipeline of a few thousand parameters per part, saved to ``directory``; ``max_shard_size``
    shards every part as diffusers' and transformers' ``save_pretrained`` do (with an index file)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=Z_DIM * 4,
        out_channels=Z_DIM,
        num_layers=layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(attention_head_dim // 2, attention_head_dim // 4, attention_head_dim // 4),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=Z_DIM * 6,
        z_dim=Z_DIM,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1] * Z_DIM,
        latents_std=[0.9] * Z_DIM,
    )
    vocab = len(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "vocab_size": vocab + 8,
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16,
        vocab_size=vocab + 8,
        vision_start_token_id=vocab + 1,
        vision_end_token_id=vocab + 2,
        vision_token_id=vocab + 3,
        image_token_id=vocab + 4,
        video_token_id=vocab + 5,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9)
    pipe = QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(str(directory), max_shard_size=max_shard_size)
    return directory


def wan_pipeline(directory: Path, *, attention_head_dim: int = 12, max_shard_size: str | None = None) -> Path:
    """A WanPipeline (text to video) of tiny parts, saved to ``directory`` (sharded as qwen_image_pipeline)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tokenizer) + 8, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_heads=4)
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=attention_head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    pipe.save_pretrained(str(directory), max_shard_size=max_shard_size)
    return directory


def image_folder(directory: Path, sizes: list[tuple[int, int]], *, fmt: str = "csv") -> Path:
    """Images of the given (width, height) with captions, in DiffSynth's layout (metadata.csv or .json)."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (w, h) in enumerate(sizes):
        generator = torch.Generator().manual_seed(index)
        pixels = (torch.rand((h, w, 3), generator=generator) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(directory / f"image_{index}.png")
        rows.append({"image": f"image_{index}.png", "prompt": f"a red square number {index}"})
    if fmt == "json":
        import json

        (directory / "metadata.json").write_text(json.dumps(rows))
    else:
        with (directory / "metadata.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["image", "prompt"])
            writer.writeheader()
            writer.writerows(rows)
    return directory


def video_folder(directory: Path, frames: int, count: int = 2, side: int = 32) -> Path:
    """Videos as frame folders with captions (a ``video`` column), in DiffSynth's layout."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    lines = ["video,prompt"]
    for index in range(count):
        folder = directory / f"clip_{index}"
        folder.mkdir()
        for frame in range(frames):
            Image.new("RGB", (side, side), (frame * 7 % 256, index * 90, 30)).save(folder / f"{frame:04d}.png")
        lines.append(f"clip_{index},a moving square number {index}")
    (directory / "metadata.csv").write_text("\n".join(lines) + "\n")
    return directory


def stand_in_roots(data: dict, tmp_path: Path) -> object:
    """Roots holding tiny stand-ins for what a diffusion config names: its pipeline, its images (or
    videos), its cache. The configs test loads each shipped config against them."""
    from types import SimpleNamespace

    from jobs import PathRoots
    from jobs.models.diffusion.data.cache import CacheWriter, model_fingerprint

    models, datasets = tmp_path / "models", tmp_path / "data"
    model = data["model"]
    pipeline = models / model["path"]
    name = model["path"].lower()
    if "flux" in name:
        from tests.jobs.models.diffusion.flux_pipelines import flux1_pipeline, flux2_pipeline

        (flux2_pipeline if "flux.2" in name or "flux2" in name else flux1_pipeline)(pipeline)
    else:
        (wan_pipeline if "wan" in name else qwen_image_pipeline)(pipeline)
    section = data["data"]
    if section["kind"] == "image_caption" and section.get("num_frames", 1) > 1:
        video_folder(datasets / section["path"], section["num_frames"])
    elif section["kind"] == "image_caption":
        image_folder(
            datasets / section["path"],
            [(64, 48)],
            fmt="json" if section.get("metadata", "").endswith("json") else "csv",
        )
    else:
        described = SimpleNamespace(
            **{"text_encoder_dtype": None, "vae_dtype": "float32", "init": "pretrained", **model, "path": pipeline}
        )
        writer = CacheWriter(datasets / section["path"], model_fingerprint(described), shard_samples=1)
        writer.add(torch.zeros(Z_DIM, 1, 8, 8), torch.zeros(3, 16), {"source_row": 0, "media": "x.png", "prompt": "x"})
        writer.finish()
    if data.get("cache"):
        (datasets / data["cache"]["path"]).parent.mkdir(parents=True, exist_ok=True)
    return PathRoots(model_roots=[models], data_roots=[datasets])
