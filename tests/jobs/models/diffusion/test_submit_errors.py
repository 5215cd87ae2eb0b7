"""Bad diffusion specs are refused at submit, each problem naming its field and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import JobSpecError, run_job
from tests.jobs.models.diffusion.helpers import cache_job, spec_from, train_job


def _problems(data, roots) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        spec_from(data, roots)
    return {p.path: p.message for p in caught.value.problems}


def test_a_directory_without_transformer_is_refused(roots, tmp_path: Path) -> None:
    (tmp_path / "models" / "empty").mkdir()
    problems = _problems(train_job(model={"path": "empty"}), roots)
    assert problems["model.path"].endswith(
        "empty has no transformer/ folder; give a diffusers pipeline directory (transformer/, vae/, ...)"
    )


def test_an_unknown_transformer_class_is_refused(roots, tmp_path: Path) -> None:
    config = tmp_path / "models" / "qwen" / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "_class_name": "SD3Transformer2DModel"}))
    problems = _problems(train_job(), roots)
    assert problems["model.path"] == (
        "transformer/config.json names class 'SD3Transformer2DModel'; supported: "
        "QwenImageTransformer2DModel, WanTransformer3DModel, FluxTransformer2DModel, Flux2Transformer2DModel"
    )


def test_training_from_a_missing_cache_says_to_run_the_cache_job(roots, tmp_path: Path) -> None:
    (tmp_path / "data" / "cache-qwen").mkdir()
    problems = _problems(train_job(), roots)
    assert problems["data.path"] == (
        f"{tmp_path / 'data' / 'cache-qwen'} holds no manifest.json; run a task: cache job with "
        f"cache.path: {tmp_path / 'data' / 'cache-qwen'} first"
    )


def test_a_cache_made_with_other_settings_is_refused(roots) -> None:
    spec = spec_from(cache_job(), roots)
    assert run_job(spec, output_dir=roots.data_roots[0] / "out").status == "succeeded"
    problems = _problems(cache_job(data={"max_pixels": 32 * 32}), roots)
    assert problems["cache.path"].startswith(f"{spec.cache.path} holds a cache made with other settings (")
    assert "max_pixels: cache has 3072, this job 1024" in problems["cache.path"]
    assert problems["cache.path"].endswith("choose another cache.path, or delete that directory to rebuild it")


def test_training_with_a_cache_from_other_encoders_is_refused(roots, tmp_path: Path) -> None:
    spec = spec_from(cache_job(), roots)
    run_job(spec, output_dir=tmp_path / "out")
    problems = _problems(train_job(model={"path": "qwen", "text_encoder_dtype": "bfloat16"}), roots)
    assert problems["data.path"].startswith(f"the cache at {spec.cache.path} was made with other encoders")
    assert "text_encoder_dtype: cache has 'float32', this job 'bfloat16'" in problems["data.path"]


def test_encoding_without_encoders_names_the_missing_folders(roots, tmp_path: Path) -> None:
    import shutil

    shutil.rmtree(tmp_path / "models" / "qwen" / "vae")
    problems = _problems(cache_job(), roots)
    assert (
        problems["model.path"]
        == f"task: cache needs the pipeline's encoders, but {tmp_path / 'models' / 'qwen'} lacks vae/"
    )


def test_task_cache_needs_a_cache_section_and_images(roots) -> None:
    problems = _problems(cache_job(cache=None), roots)
    assert problems["cache"] == "task: cache needs a cache section: cache: {path: <directory under a data root>}"


def test_qwen_image_refuses_video_frames_and_lora_names_it_lacks(roots) -> None:
    problems = _problems(
        train_job(
            data={"kind": "image_caption", "path": "images", "num_frames": 5},
            lora={"target_modules": ["to_q", "attn.q_proj"]},
        ),
        roots,
    )
    assert problems["data.num_frames"] == "Qwen-Image trains on images; set it to 1 (got 5)"
    assert problems["lora.target_modules"].startswith("['attn.q_proj'] match no Linear module of diffusers_transformer")


def test_a_gguf_or_merged_export_of_a_diffusion_job_is_refused_naming_the_field(roots) -> None:
    data = {"kind": "image_caption", "path": "images", "max_pixels": 64 * 48}  # no cache needed to check it
    problems = _problems(train_job(data=data, export={"gguf": {"quant": "q8_0"}, "merged": True}), roots)
    assert problems["export.gguf"] == (
        "model kind 'diffusers_transformer' cannot be exported as gguf (it has none); remove export.gguf"
    )
    assert problems["export.merged"].startswith("model kind 'diffusers_transformer' cannot be exported as merged")
