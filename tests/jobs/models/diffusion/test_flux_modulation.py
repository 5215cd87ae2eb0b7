"""Flux.1's modulation computed once per DiT call: bitwise the DiT's own values, its weights copied once a step."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from jobs import PathRoots
from jobs.models.diffusion.flux.modulation import FluxModulation, flux_modulation
from jobs.models.diffusion.model import apply_dit_lora, enable_dit_checkpointing, flow_loss
from jobs.recompute import apply_activation_checkpointing
from offload import OffloadOptions, OffloadTrainingManager, discover_units
from tests.jobs.models.diffusion.flux_pipelines import FLUX1_TARGETS
from tests.jobs.models.diffusion.helpers import cache_job, train_job
from tests.jobs.models.diffusion.test_flux import SAMPLE, TARGETS, _losses, _run, flux_job
from tests.jobs.models.diffusion.test_submit_errors import _problems

pytestmark = pytest.mark.filterwarnings("ignore")
MODULATION = ["norm1.linear", "norm1_context.linear", "norm.linear"]


def _dit(dtype: torch.dtype, targets: list[str] = FLUX1_TARGETS) -> nn.Module:
    """A tiny FluxTransformer2DModel (diffusers' own class) with nonzero LoRA adapters and checkpointed blocks."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    dit = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    ).to(dtype)  # fmt: skip
    dit = apply_dit_lora(dit, SimpleNamespace(rank=4, alpha=None, dropout=0.0, target_modules=targets))
    for name, param in dit.named_parameters():
        if "lora_B" in name:  # nonzero adapters, so every adapter changes the output
            param.data.normal_(generator=torch.Generator().manual_seed(1))
    enable_dit_checkpointing(dit)
    apply_activation_checkpointing(dit)  # Ferry's checkpoint, as the trainer applies it
    return dit


def _batch(size: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(size, 4, 1, 8, 8, generator=generator)
    return {
        "latents": latents,
        "noise": torch.randn(latents.shape, generator=generator),
        "sigma": torch.rand(size, generator=generator),
        "prompt_embeds": torch.randn(size, 5, 32, generator=generator),
        "pooled_prompt_embeds": torch.randn(size, 16, generator=generator),  # differs per sample, as prompts do
        "guidance": torch.full((size,), 3.5),
        "weight": torch.ones(size),
    }


def _loss_and_grads(dit: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = flow_loss(dit, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in dit.named_parameters() if p.grad is not None}
    dit.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize(
    ("dtype", "autocast"), [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
)
def test_the_dit_computes_bitwise_its_own_output_loss_and_gradients(dtype: torch.dtype, autocast: bool) -> None:
    from diffusers import FluxTransformer2DModel

    plain = _dit(dtype, [*FLUX1_TARGETS, "norm1.linear"])  # an adapter on a modulation layer trains beside its rows
    precomputed = copy.deepcopy(plain)
    FluxModulation.install(precomputed)
    assert type(plain) is FluxTransformer2DModel and flux_modulation(plain) is None
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    for seed in range(2):  # batches of two prompts; checkpointed blocks: the recomputation reads the same rows
        batch = _batch(2, seed)
        with context:
            want_loss, want = _loss_and_grads(plain, batch)
            got_loss, got = _loss_and_grads(precomputed, batch)
        assert torch.equal(want_loss, got_loss)
        assert want.keys() == got.keys() and any("norm1.linear.lora_B" in name for name in got)
        assert all(torch.equal(want[name], got[name]) for name in want)
    inputs = {
        "hidden_states": torch.randn(2, 16, 16).to(dtype), "encoder_hidden_states": torch.randn(2, 5, 32).to(dtype),
        "pooled_projections": torch.randn(2, 16).to(dtype), "timestep": torch.rand(2).to(dtype),
        "guidance": torch.full((2,), 3.5), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(5, 3),
        "return_dict": False,
    }  # fmt: skip
    with torch.no_grad(), context:  # the DiT's own call, as samples make it
        assert torch.equal(plain(**inputs)[0], precomputed(**inputs)[0])


def test_the_layers_move_into_units_of_their_own_and_remove_restores_the_model() -> None:
    dit = _dit(torch.float32, [*FLUX1_TARGETS, "norm.linear"])
    before = {name: tensor.clone() for name, tensor in dit.state_dict().items()}
    modules = {name: type(module) for name, module in dit.named_modules()}
    modulation = FluxModulation.install(dit)
    moved = {name for name in before if any(f".{layer}." in name for layer in MODULATION) and "lora_" not in name}
    assert len(moved) == 2 * 2 * 2 + 3 * 2  # weight and bias: two layers a double block, one a single block
    assert set(before) - set(dit.state_dict()) == moved
    assert "flux_modulation.transformer_blocks.1.norm1_context.weight" in dit.state_dict()
    assert "flux_modulation.single_transformer_blocks.2.norm.bias" in dit.state_dict()
    assert "single_transformer_blocks.2.norm.linear.lora_A.default.weight" in dit.state_dict()  # the adapter stays
    units = {plan.name: {name for name, _ in plan.tensors} for plan in discover_units(dit, granularity="block")}
    assert units["flux_modulation.transformer_blocks.0"] == {
        f"flux_modulation.transformer_blocks.0.{n}.{p}" for n in ("norm1", "norm1_context") for p in ("weight", "bias")
    }
    assert not any(name in moved for name in units["transformer_blocks.0"] | units["single_transformer_blocks.0"])
    modulation.remove(dit)
    after = dit.state_dict()
    assert flux_modulation(dit) is None and {name: type(module) for name, module in dit.named_modules()} == modules
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_trainable_modulation_layer_or_time_embedding_is_refused() -> None:
    dit = _dit(torch.float32)
    dit.single_transformer_blocks[1].norm.linear.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"single_transformer_blocks.1.norm.linear trains"):
        FluxModulation.install(dit)
    dit = _dit(torch.float32)
    dit.time_text_embed.guidance_embedder.linear_1.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"time_text_embed trains"):
        FluxModulation.install(dit)
    FluxModulation.separate(dit)  # no checks: a temb that requires grad is refused when the DiT computes it
    with pytest.raises(RuntimeError, match="time_text_embed's output requires grad"):
        flow_loss(dit, _batch(1, 0))


def _copied_per_step(dit: nn.Module, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Bytes the engine copied to the device in each step (every visit copies), and the losses."""
    manager = OffloadTrainingManager(
        dit, "cpu", options=OffloadOptions(granularity="block", prefetch=1, reuse_ring_slots=False)
    )
    copied, losses = [], []
    for step in range(steps):
        loss = flow_loss(dit, _batch(2, step))
        loss.backward()
        manager.after_backward()
        dit.zero_grad(set_to_none=True)
        copied.append(manager.stats().last_step_h2d_bytes)
        losses.append(loss.detach())
    manager.remove()
    return copied, losses


def test_the_engine_copies_the_modulation_layers_once_a_step_instead_of_twice() -> None:
    streamed = _dit(torch.float32)
    precomputed = copy.deepcopy(streamed)
    FluxModulation.install(precomputed)
    resident = [flow_loss(copy.deepcopy(streamed), _batch(2, step)).detach() for step in range(3)]
    mod_bytes = sum(p.nbytes for n, p in streamed.named_parameters() if any(f".{m}." in n for m in MODULATION))
    before, streamed_losses = _copied_per_step(streamed, 3)
    after, precomputed_losses = _copied_per_step(precomputed, 3)
    assert all(torch.equal(a, b) for a, b in zip(resident, streamed_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(resident, precomputed_losses, strict=True))
    # Streamed with their blocks, the layers cross in the forward and again in the recomputation; precomputed,
    # once, in their own units at the start of the forward.
    assert [b - a for b, a in zip(before, after, strict=True)] == [mod_bytes] * 3
    print(f"H2D bytes per step, streamed {before[-1]}, precomputed {after[-1]}; modulation layers {mod_bytes}")


def _onloaded_per_step(events: list[dict]) -> list[int]:
    """Weight bytes each step brought to the device: copied, or found still in their ring slot."""
    totals = [e["offload"]["h2d_bytes"] + e["offload"]["reused_bytes"] for e in events if e["type"] == "step"]
    return [after - before for before, after in itertools.pairwise(totals)]


def test_an_offloaded_flux1_job_precomputes_by_default_and_equals_resident_training(
    flux_roots: PathRoots, tmp_path: Path
) -> None:
    _run(cache_job("flux1", data={"max_sequence_length": 32}), flux_roots, tmp_path / "cache-job")
    offload = {"enable_model_cpu_offload": True, "granularity": "block", "prefetch": 2}
    plain = _run(flux_job("flux1", sample=SAMPLE), flux_roots, tmp_path / "plain")
    precomputed = _run(flux_job("flux1", offload=offload, sample=SAMPLE), flux_roots, tmp_path / "precomputed")
    streamed = _run(
        flux_job("flux1", offload=offload, sample=SAMPLE, model={"precompute_modulation": False}),
        flux_roots,
        tmp_path / "streamed",
    )
    assert _losses(plain) == _losses(precomputed) == _losses(streamed) and len(_losses(plain)) == 4
    final = "checkpoints/step-00000004"
    adapters = [
        load_file(str(tmp_path / d / final / "pytorch_lora_weights.safetensors")) for d in ("plain", "precomputed")
    ]
    assert adapters[0].keys() == adapters[1].keys() and all(
        torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0]
    )
    assert (tmp_path / "plain" / final / "sample-00.png").read_bytes() == (
        tmp_path / "precomputed" / final / "sample-00.png"
    ).read_bytes()
    # The tiny DiT (1 double, 2 single blocks, width 32) in float32: what each step no longer copies a second time.
    mod_bytes = (2 * (32 * 192 + 192) + 2 * (32 * 96 + 96)) * 4
    saved = [s - p for s, p in zip(_onloaded_per_step(streamed), _onloaded_per_step(precomputed), strict=True)]
    assert saved == [mod_bytes] * 3  # samples at step 2 read each layer once per DiT call either way


def test_precompute_modulation_is_refused_where_flux_cannot_use_it(flux_roots: PathRoots) -> None:
    def problem(family: str, **sections: Any) -> str:
        images = {"kind": "image_caption", "path": "images", "max_pixels": 64 * 48}
        lora = {"target_modules": TARGETS[family], "rank": 4}
        job = train_job(family, **{"lora": lora, "data": images, "model": {"precompute_modulation": True}, **sections})
        return _problems(job, flux_roots)["model.precompute_modulation"]

    assert problem("flux2").startswith("Flux.2's DiT computes its modulation once per call already")
    assert problem("flux1", lora=None) == (
        "a full fine-tune trains norm1.linear, norm1_context.linear and norm.linear; the precomputed modulation "
        "needs them frozen (add a lora section); set it to false or leave it out"
    )
    assert problem("flux1", lora={"target_modules": [*FLUX1_TARGETS, "linear_2"], "rank": 4}) == (
        "lora.target_modules 'linear_2' trains time_text_embed.timestep_embedder.linear_2, the modulation's input, "
        "which must stay frozen; set it to false or leave it out"
    )
