"""Flux.1 and Flux.2 end to end on tiny random pipelines: cache, LoRA under offload equal to resident, samples,
the saved LoRA in FluxPipeline / Flux2Pipeline, and the encodings against the pipelines' own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from jobs import PathRoots, run_job
from jobs.events import event_to_wire
from jobs.models.diffusion.data.cache import CachedSamples
from tests.jobs.models.diffusion.flux_pipelines import FLUX1_TARGETS, FLUX2_TARGETS
from tests.jobs.models.diffusion.helpers import cache_job, spec_from, train_job

pytestmark = pytest.mark.filterwarnings("ignore")
TARGETS = {"flux1": FLUX1_TARGETS, "flux2": FLUX2_TARGETS}
SAMPLE = {"every_steps": 2, "prompts": ["a red square"], "height": 32, "width": 32, "guidance_scale": 3.5}
PIPELINES = {"flux1": "FluxPipeline", "flux2": "Flux2Pipeline"}


def flux_job(family: str, **sections: Any) -> dict[str, Any]:
    return train_job(
        family,
        lora={"target_modules": TARGETS[family], "rank": 4},
        data={"kind": "diffusion_cache", "path": f"cache-{family}"},
        **sections,
    )


def _run(data: dict, roots: PathRoots, output: Path) -> list[dict]:
    events: list[dict] = []
    outcome = run_job(spec_from(data, roots), output_dir=output, report=lambda e: events.append(event_to_wire(e)))
    assert outcome.status == "succeeded", events[-1]
    return events


def _losses(events: list[dict]) -> list[float]:
    return [e["loss"] for e in events if e["type"] == "step"]


def _pipeline_image(family: str, path: Path, lora: Path | None) -> torch.Tensor:
    import diffusers

    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe(
        prompt="a red square",
        height=32,
        width=32,
        num_inference_steps=2,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        return_dict=False,
    )[0]


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_flux_lora_offloaded_equals_resident_samples_and_loads_into_the_pipeline(
    family: str, flux_roots: PathRoots, tmp_path: Path
) -> None:
    _run(cache_job(family, data={"max_sequence_length": 32}), flux_roots, tmp_path / "cache-job")
    cache = CachedSamples(tmp_path / "data" / f"cache-{family}")
    assert len(cache) == 4 and cache.empty_prompt() is not None
    assert len(cache.sample(0)) == (3 if family == "flux1" else 2)  # Flux.1 keeps CLIP's pooled embedding

    plain = _run(flux_job(family, sample=SAMPLE), flux_roots, tmp_path / "plain")
    offloaded = _run(
        flux_job(family, sample=SAMPLE, offload={"enable_model_cpu_offload": True, "prefetch": 2}),
        flux_roots,
        tmp_path / "offload",
    )
    assert _losses(plain) == _losses(offloaded) and len(_losses(plain)) == 4
    checkpoint = tmp_path / "offload" / "checkpoints" / "step-00000004"
    a, b = (
        load_file(str(tmp_path / d / "checkpoints/step-00000004/pytorch_lora_weights.safetensors"))
        for d in ("plain", "offload")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in a)
    assert (checkpoint / "sample-00.png").is_file()
    assert [s["step"] for s in offloaded if s["type"] == "sample"] == [2, 4]

    path = tmp_path / "models" / family
    before, after = _pipeline_image(family, path, None), _pipeline_image(family, path, checkpoint)
    assert before.shape == after.shape == (1, 3, 32, 32) and not torch.equal(before, after)


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_prompts_and_latents_encode_as_the_pipeline_does(family: str, flux_roots: PathRoots, tmp_path: Path) -> None:
    import diffusers

    from jobs.models.diffusion.encode import Encoders

    spec = spec_from(cache_job(family), flux_roots)
    encoders = Encoders.load(spec, torch.device("cpu"), with_text=True, with_vae=True)
    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(str(tmp_path / "models" / family))
    ours = encoders.encode_prompts(["a red square"], 32)[0]
    pixels = torch.rand(1, 3, 1, 32, 32) * 2 - 1
    latents = encoders.encode_pixels(pixels)
    with torch.no_grad():  # as the pipeline's __call__ runs it (and Encoders do)
        if family == "flux1":
            theirs, pooled, _ = pipe.encode_prompt("a red square", prompt_2=None, max_sequence_length=32)
            assert torch.equal(encoders.encode_pooled(["a red square"])[0], pooled[0])
        else:  # Flux2Pipeline._encode_vae_image: the mode, patchified, batch-norm normalized
            theirs, _ = pipe.encode_prompt("a red square", max_sequence_length=32)
            assert torch.equal(latents[:, :, 0], pipe._encode_vae_image(pixels[:, :, 0], None))
    assert torch.equal(ours, theirs[0])
    decoded = encoders.decode(latents)
    assert decoded.shape == pixels.shape
