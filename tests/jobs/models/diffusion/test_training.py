"""Split training end to end on tiny random pipelines: cache, train, samples, and the result in diffusers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jobs import run_job
from jobs.events import event_to_wire
from jobs.models.diffusion.data.cache import CachedSamples, read_manifest
from tests.jobs.models.diffusion.helpers import cache_job, spec_from, train_job

pytestmark = pytest.mark.filterwarnings("ignore")
SAMPLE = {"every_steps": 2, "prompts": ["a red square", "a blue circle"], "height": 32, "width": 32}


def _run(data, roots, output: Path, **kwargs) -> list[dict]:
    events: list[dict] = []
    outcome = run_job(
        spec_from(data, roots), output_dir=output, report=lambda e: events.append(event_to_wire(e)), **kwargs
    )
    assert outcome.status == "succeeded", events[-1]
    return events


def _pipeline_output(pipe_cls, path: Path, lora: Path | None, **call) -> torch.Tensor:
    pipe = pipe_cls.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe(
        "a red square", generator=torch.Generator().manual_seed(0), output_type="pt", return_dict=False, **call
    )[0]


def test_qwen_image_cache_train_lora_loads_into_the_pipeline_with_samples(roots, tmp_path: Path) -> None:
    from diffusers import QwenImagePipeline

    cache_events = _run(cache_job(), roots, tmp_path / "cache-job")
    progress = [e for e in cache_events if e["type"] == "cache_progress"]
    assert [e["step"] for e in progress] == [1, 2, 3, 4] and progress[-1]["samples_per_s"] > 0
    manifest = read_manifest(tmp_path / "data" / "cache-qwen")
    assert manifest["complete"] and manifest["samples"] == 4 and len(manifest["shards"]) == 2
    row = manifest["shards"][0]["rows"][2]
    assert (
        row["source_row"] == 2 and row["media"] == "image_2.png" and row["latents_shape"] == [4, 1, 16, 12]
    )  # the tiny VAE: 4x

    events = _run(train_job(sample=SAMPLE), roots, tmp_path / "train")
    checkpoint = Path([e for e in events if e["type"] == "checkpoint"][-1]["path"])
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "manifest.json", "pytorch_lora_weights.safetensors", "sample-00.png", "sample-01.png", "training_state.pt",
    ]  # fmt: skip
    lora = load_file(str(checkpoint / "pytorch_lora_weights.safetensors"))
    assert all(k.startswith("transformer.") for k in lora) and any("img_mod.1.lora_A" in k for k in lora)

    samples = [e for e in events if e["type"] == "sample"]
    prompts = SAMPLE["prompts"]
    assert [(s["step"], s["prompt"]) for s in samples] == [(step, p) for step in (2, 4) for p in prompts]
    assert samples[0]["artifact_path"] == "samples/step-00000002/sample-00.png"
    assert samples[0]["media_type"] == "image/png"
    assert sorted(p.name for p in (tmp_path / "train" / "samples" / "step-00000002").iterdir()) == [
        "sample-00.png",
        "sample-01.png",
    ]
    from PIL import Image

    assert Image.open(checkpoint / "sample-00.png").size == (32, 32)

    path = tmp_path / "models" / "qwen"
    before = _pipeline_output(QwenImagePipeline, path, None, height=32, width=32, num_inference_steps=2)
    after = _pipeline_output(QwenImagePipeline, path, checkpoint, height=32, width=32, num_inference_steps=2)
    assert before.shape == after.shape and not torch.equal(before, after)


def test_wan_lora_from_a_cache_loads_into_the_wan_pipeline(roots, tmp_path: Path) -> None:
    from diffusers import WanPipeline

    _run(cache_job("wan"), roots, tmp_path / "cache-job")
    events = _run(train_job("wan", sample={**SAMPLE, "num_frames": 5}), roots, tmp_path / "train")
    checkpoint = Path([e for e in events if e["type"] == "checkpoint"][-1]["path"])
    assert "sample-00-f004.png" in {p.name for p in checkpoint.iterdir()}  # 5 frames: one PNG each
    path = tmp_path / "models" / "wan"
    call = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 1.0}
    before = _pipeline_output(WanPipeline, path, None, **call)
    after = _pipeline_output(WanPipeline, path, checkpoint, **call)
    assert not torch.equal(before, after)


def test_a_cache_continues_after_a_stop_and_is_reused_when_complete(roots, tmp_path: Path) -> None:
    polls = iter([None, None, "pause"])
    spec = spec_from(cache_job(cache={"shard_samples": 2}), roots)
    outcome = run_job(spec, output_dir=tmp_path / "a", should_stop=lambda: next(polls, None))
    assert outcome.status == "paused" and outcome.step == 2
    assert read_manifest(spec.cache.path)["complete"] is False

    events: list[dict] = []
    run_job(spec, output_dir=tmp_path / "a", report=lambda e: events.append(event_to_wire(e)))
    assert events[0]["resumed_from_step"] == 2
    assert [e["step"] for e in events if e["type"] == "cache_progress"] == [3, 4]
    resumed = CachedSamples(spec.cache.path)

    _run(cache_job(cache={"path": "straight", "shard_samples": 2}), roots, tmp_path / "b")
    straight = CachedSamples(tmp_path / "data" / "straight")
    for index in range(4):
        assert all(torch.equal(a, b) for a, b in zip(resumed.sample(index), straight.sample(index), strict=True))

    again: list[dict] = []
    run_job(spec, output_dir=tmp_path / "c", report=lambda e: again.append(event_to_wire(e)))
    assert [e["type"] for e in again] == ["started", "log", "finished"]
    assert again[1]["message"].endswith("is complete with these settings (4 samples); reused")


def test_lora_training_with_offload_equals_training_without_bitwise(roots, tmp_path: Path) -> None:
    _run(cache_job(), roots, tmp_path / "cache-job")
    plain = _run(train_job(), roots, tmp_path / "plain")
    offloaded = _run(train_job(offload={"enable_model_cpu_offload": True, "prefetch": 2}), roots, tmp_path / "offload")
    losses = [[e["loss"] for e in run if e["type"] == "step"] for run in (plain, offloaded)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    a, b = (
        load_file(str(tmp_path / d / "checkpoints/step-00000004/pytorch_lora_weights.safetensors"))
        for d in ("plain", "offload")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_full_finetune_with_offload_equals_without_and_saves_transformer(roots, tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    _run(cache_job("wan"), roots, tmp_path / "cache-job")
    job = train_job("wan", lora=None, training={"steps": 3})
    plain = _run(job, roots, tmp_path / "plain")
    offloaded = _run({**job, "offload": {"enable_model_cpu_offload": True}}, roots, tmp_path / "offload")
    assert [e["loss"] for e in plain if e["type"] == "step"] == [e["loss"] for e in offloaded if e["type"] == "step"]
    folder = tmp_path / "offload" / "checkpoints" / "step-00000003" / "transformer"
    names = {f["name"] for f in json.loads((folder.parent / "manifest.json").read_text())["files"]}
    assert {"transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"} <= names
    trained = WanTransformer3DModel.from_pretrained(str(folder))
    original = WanTransformer3DModel.from_pretrained(str(tmp_path / "models" / "wan" / "transformer"))
    plain_state = load_file(
        str(tmp_path / "plain/checkpoints/step-00000003/transformer/diffusion_pytorch_model.safetensors")
    )
    assert all(torch.equal(v, plain_state[k]) for k, v in trained.state_dict().items())
    assert not torch.equal(trained.proj_out.weight, original.proj_out.weight)


def test_on_the_fly_encoding_trains_exactly_as_the_cache(roots, tmp_path: Path) -> None:
    _run(cache_job(), roots, tmp_path / "cache-job")
    cached = _run(train_job(training={"steps": 3}), roots, tmp_path / "cached")
    images = {"kind": "image_caption", "path": "images", "max_pixels": 64 * 48}
    live = _run(train_job(data=images, training={"steps": 3}), roots, tmp_path / "live")
    assert [e["loss"] for e in cached if e["type"] == "step"] == [e["loss"] for e in live if e["type"] == "step"]


def test_a_resumed_lora_job_continues_exactly(roots, tmp_path: Path) -> None:
    _run(cache_job(), roots, tmp_path / "cache-job")
    straight = _run(train_job(training={"steps": 4}), roots, tmp_path / "straight")
    _run(train_job(training={"steps": 2}), roots, tmp_path / "resumed")
    resumed = _run(train_job(training={"steps": 4}), roots, tmp_path / "resumed")
    assert resumed[0]["resumed_from_step"] == 2
    assert [e["loss"] for e in straight if e["type"] == "step"][2:] == [
        e["loss"] for e in resumed if e["type"] == "step"
    ]


def test_python_dash_m_jobs_runs_a_cache_job(roots, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from jobs.cli import main

    spec = tmp_path / "cache.yaml"
    spec.write_text(yaml.safe_dump(cache_job()))
    argv = ["run", str(spec), "--output", str(tmp_path / "out")]
    argv += ["--model-root", str(roots.model_roots[0]), "--data-root", str(roots.data_roots[0])]
    assert main(argv) == 0
    assert read_manifest(tmp_path / "data" / "cache-qwen")["samples"] == 4
    assert "4/4" in capsys.readouterr().err  # the progress bar counted the samples
