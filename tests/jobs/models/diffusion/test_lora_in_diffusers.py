"""A Ferry DiT LoRA checkpoint in diffusers: the family's pipeline loads it with ``load_lora_weights`` and its
transformer then gives, on the same inputs, exactly the outputs of Ferry's own model with the adapter on.

The adapter covers every Linear of the tiny DiT (attention, MLPs, modulation, embedders, the output head), so
a key diffusers renames, drops or cannot place shows up as a difference here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from jobs.models.diffusion.components import load_transformer
from jobs.models.diffusion.model import apply_dit_lora, family_of_model, save_dit
from jobs.models.diffusion.variants import Conditioning
from jobs.models.family import linear_module_names

pytestmark = pytest.mark.filterwarnings("ignore")
PIPELINES = {"qwen": "QwenImagePipeline", "wan": "WanPipeline", "flux1": "FluxPipeline", "flux2": "Flux2Pipeline"}


def _inputs(dit: Any, family: str) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:
    config = dit.config
    generator = torch.Generator().manual_seed(1)
    if family == "wan":  # video latents [B, C, F, H, W], umT5 embeddings
        latents = torch.randn(1, config.in_channels, 2, 4, 4, generator=generator)
        return latents, torch.tensor([0.6]), Conditioning(torch.randn(1, 5, config.text_dim, generator=generator))
    channels = config.in_channels if family == "flux2" else config.in_channels // 4  # 2x2 patches packed
    latents = torch.randn(1, channels, 1, 4, 4, generator=generator)
    embeds = torch.randn(1, 5, config.joint_attention_dim, generator=generator)
    pooled = torch.randn(1, config.pooled_projection_dim, generator=generator) if family == "flux1" else None
    guidance = torch.tensor([3.5]) if getattr(config, "guidance_embeds", False) else None
    mask = torch.ones(1, 5, dtype=torch.long) if family == "qwen" else None
    return latents, torch.tensor([0.6]), Conditioning(embeds, mask, pooled, guidance)


def _ferry_lora_checkpoint(path: Path, checkpoint: Path) -> Any:
    """Ferry's DiT with a LoRA on every Linear, its adapter weights random (as trained ones are: B != 0)."""
    dit = load_transformer(path, "pretrained", torch.float32, 0)
    targets = sorted({name for name in linear_module_names(dit)})
    dit = apply_dit_lora(dit, SimpleNamespace(rank=4, alpha=8, dropout=0.0, target_modules=targets))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, parameter in dit.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.2)
    checkpoint.mkdir()
    save_dit(dit, checkpoint)
    return dit.eval()


@pytest.mark.parametrize("family", ["qwen", "wan", "flux1", "flux2"])
def test_a_ferry_lora_changes_the_pipelines_transformer_exactly_as_ferrys_model(
    family: str, pipelines: Path, flux_pipelines: Path, tmp_path: Path
) -> None:
    import diffusers

    path = (pipelines if family in ("qwen", "wan") else flux_pipelines) / family
    ferry = _ferry_lora_checkpoint(path, tmp_path / "step-00000001")
    latents, sigma, cond = _inputs(ferry, family)
    predict = family_of_model(ferry).predict

    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(str(path))
    with torch.no_grad():
        before = predict(pipe.transformer, latents, sigma, cond)
        pipe.load_lora_weights(str(tmp_path / "step-00000001"))
        after = predict(pipe.transformer, latents, sigma, cond)
        expected = predict(ferry, latents, sigma, cond)
    wrapped = {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {n for n, m in ferry.named_modules() if hasattr(m, "lora_A")}  # every adapter placed
    assert not torch.allclose(before, expected, atol=1e-3)  # the adapter matters ...
    torch.testing.assert_close(after, expected, rtol=0, atol=0)  # ... and diffusers applies it as Ferry does
