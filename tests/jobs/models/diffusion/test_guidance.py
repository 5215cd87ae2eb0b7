"""Classifier-free guidance in the samples (``sample.guidance_scale``, ``sample.negative_prompt``), as the
families' diffusers pipelines combine the two predictions."""

from __future__ import annotations

import pytest
import torch

from jobs.models.diffusion.family import make_sampler
from jobs.models.diffusion.variants import FAMILIES
from jobs.models.registry import FAMILIES as MODEL_FAMILIES
from tests.jobs.models.diffusion.helpers import spec_from, train_job

pytestmark = pytest.mark.filterwarnings("ignore")
QWEN, WAN = FAMILIES["QwenImageTransformer2DModel"], FAMILIES["WanTransformer3DModel"]


def test_qwen_image_guidance_is_its_pipelines_true_cfg_with_the_norm_rescale() -> None:
    from diffusers import QwenImagePipeline

    torch.manual_seed(0)
    cond, uncond = torch.randn(2, 16, 1, 8, 6), torch.randn(2, 16, 1, 8, 6)
    # QwenImagePipeline.__call__ on its packed tokens (the loop's do_true_cfg branch).
    pack = QwenImagePipeline._pack_latents
    noise_pred, neg_noise_pred = (pack(x[:, :, 0], 2, 16, 8, 6) for x in (cond, uncond))
    comb_pred = neg_noise_pred + 4.0 * (noise_pred - neg_noise_pred)
    expected = comb_pred * (torch.norm(noise_pred, dim=-1, keepdim=True) / torch.norm(comb_pred, dim=-1, keepdim=True))
    guided = QWEN.guide(cond, uncond, 4.0)
    assert guided.shape == cond.shape
    assert torch.equal(pack(guided[:, :, 0], 2, 16, 8, 6), expected)


def test_wan_guidance_is_plain_cfg() -> None:
    cond, uncond = torch.randn(1, 16, 2, 4, 4), torch.randn(1, 16, 2, 4, 4)
    assert torch.equal(WAN.guide(cond, uncond, 5.0), uncond + 5.0 * (cond - uncond))


@pytest.mark.parametrize("family", ["qwen", "wan"])
def test_guided_samples_call_the_dit_twice_a_step_and_differ_from_unguided_ones(roots, family: str) -> None:
    sample = {"every_steps": 2, "prompts": ["a red square"], "height": 32, "width": 32, "num_inference_steps": 3}
    device = torch.device("cpu")
    images_data = {"kind": "image_caption", "path": "images", "max_pixels": 64 * 48}  # no cache needed here
    plain = spec_from(train_job(family, data=images_data, sample=sample), roots)
    guided_sample = {**sample, "guidance_scale": 4.0, "negative_prompt": "blurry"}
    guided = spec_from(train_job(family, data=images_data, sample=guided_sample), roots)
    model = MODEL_FAMILIES["diffusers_transformer"].build(plain.model, 0)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    images = {}
    for name, spec in (("plain", plain), ("guided", guided), ("again", guided)):
        calls.clear()
        sampler = make_sampler(spec, device)
        images[name] = sampler.generate(model, device)[0]
        sampler.close()
        assert len(calls) == 3 * (2 if spec.sample.guidance_scale > 1 else 1), name
    assert not torch.equal(images["plain"], images["guided"])
    assert torch.equal(images["guided"], images["again"]), "a fixed seed gives the same guided sample"


def test_guidance_below_one_is_refused_naming_the_field(roots) -> None:
    from jobs import JobSpecError

    with pytest.raises(JobSpecError, match="sample.guidance_scale"):
        spec_from(train_job(sample={"every_steps": 2, "prompts": ["x"], "guidance_scale": 0.5}), roots)
