"""Qwen-Image's modulation computed once per timestep: the DiT's own values, weights the engine never moves."""

from __future__ import annotations

import contextlib
import copy
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from jobs.models.diffusion.flow_match import sigmas
from jobs.models.diffusion.model import apply_dit_lora, enable_dit_checkpointing, flow_loss
from jobs.models.diffusion.modulation_table import modulation_table, precompute_modulation
from jobs.recompute import apply_activation_checkpointing
from tests.jobs.models.diffusion.helpers import QWEN_TARGETS, cache_job, train_job
from tests.jobs.models.diffusion.test_submit_errors import _problems
from tests.jobs.models.diffusion.test_training import SAMPLE, _run

pytestmark = pytest.mark.filterwarnings("ignore")
SCHEDULE = sigmas("qwen_image", 1000).float()


def _lora_dit(dtype: torch.dtype) -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    dit = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    ).to(dtype)  # fmt: skip
    dit = apply_dit_lora(dit, SimpleNamespace(rank=4, alpha=None, dropout=0.0, target_modules=QWEN_TARGETS))
    for name, param in dit.named_parameters():
        if "lora_B" in name:  # nonzero adapters, so the modulation's LoRA changes the output
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
        "sigma": SCHEDULE[torch.randint(0, 1000, (size,), generator=generator)],
        "prompt_embeds": torch.randn(size, 5, 16, generator=generator),
        "weight": torch.ones(size),
    }


def _loss_and_grads(dit: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = flow_loss(dit, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in dit.named_parameters() if p.grad is not None}
    dit.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_one_gets_bitwise_the_loss_and_gradients_the_dit_computes_itself(dtype: torch.dtype) -> None:
    plain = _lora_dit(dtype)
    tabled = copy.deepcopy(plain)
    table = precompute_modulation(tabled, SCHEDULE, torch.device("cpu"), contextlib.nullcontext)
    # bf16 collapses the 1000 sigmas to the values the DiT's bf16 time embedding can tell apart.
    assert len(table.keys) == (1000 if dtype == torch.float32 else 378)
    for seed in range(3):  # checkpointed blocks: the backward's recomputation reads the same rows
        batch = _batch(1, seed)
        want_loss, want = _loss_and_grads(plain, batch)
        got_loss, got = _loss_and_grads(tabled, {**batch, "modulation": table.rows_for(batch["sigma"])})
        assert torch.equal(want_loss, got_loss)
        assert want.keys() == got.keys() and any("img_mod.1.lora_B" in name for name in got)
        assert all(torch.equal(want[name], got[name]) for name in want)


def test_the_modulation_weights_leave_the_model_and_remove_puts_them_back() -> None:
    dit = _lora_dit(torch.float32)
    before = {name: tensor.clone() for name, tensor in dit.state_dict().items()}
    mod_bytes = sum(
        dit.get_submodule(f"transformer_blocks.{b}.{s}.1.base_layer").weight.nbytes
        + dit.get_submodule(f"transformer_blocks.{b}.{s}.1.base_layer").bias.nbytes
        for b in range(2)
        for s in ("img_mod", "txt_mod")
    )
    table = precompute_modulation(dit, SCHEDULE, torch.device("cpu"), contextlib.nullcontext)
    assert modulation_table(dit) is table
    gone = set(before) - set(dit.state_dict())
    assert gone == {f"transformer_blocks.{b}.{s}.1.base_layer.{p}" for b in range(2) for s in ("img_mod", "txt_mod") for p in ("weight", "bias")}  # fmt: skip
    assert sum(before[name].nbytes for name in gone) == mod_bytes
    table.remove(dit)
    assert modulation_table(dit) is None
    after = dit.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_an_unknown_timestep_and_a_call_without_rows_are_refused() -> None:
    dit = _lora_dit(torch.float32)
    table = precompute_modulation(dit, SCHEDULE[:10], torch.device("cpu"), contextlib.nullcontext)
    with pytest.raises(KeyError, match="no precomputed modulation for sigma"):
        table.rows_for(SCHEDULE[10:12])
    with pytest.raises(ValueError, match="its batch needs rows"):
        flow_loss(dit, _batch(1, 0) | {"sigma": SCHEDULE[:1]})  # a batch without its rows
    with pytest.raises(RuntimeError, match="call table.feed"):  # a DiT called before any rows were fed
        dit(hidden_states=torch.zeros(1, 16, 16), timestep=SCHEDULE[:1], encoder_hidden_states=torch.zeros(1, 5, 16),
            img_shapes=[[(1, 4, 4)]])  # fmt: skip


def test_a_trainable_modulation_layer_or_time_embedding_is_refused() -> None:
    dit = _lora_dit(torch.float32)
    dit.transformer_blocks[1].txt_mod[1].base_layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"transformer_blocks.1.txt_mod.1 trains"):
        precompute_modulation(dit, SCHEDULE, torch.device("cpu"), contextlib.nullcontext)
    dit = _lora_dit(torch.float32)
    dit.time_text_embed.timestep_embedder.linear_2.bias.requires_grad_(True)
    with pytest.raises(ValueError, match=r"time_text_embed trains"):
        precompute_modulation(dit, SCHEDULE, torch.device("cpu"), contextlib.nullcontext)


def test_by_default_a_job_whose_lora_trains_the_time_embedding_streams_the_modulation(
    roots, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(cache_job(), roots, tmp_path / "cache-job")
    lora = {"target_modules": [*QWEN_TARGETS, "linear_1"], "rank": 4}  # linear_1: the timestep embedder's
    offload = {"enable_model_cpu_offload": True}
    plain = _run(train_job(lora=lora, training={"steps": 2}), roots, tmp_path / "plain")
    with caplog.at_level("WARNING"):
        offloaded = _run(train_job(lora=lora, offload=offload, training={"steps": 2}), roots, tmp_path / "offload")
    assert "model.precompute_modulation is off for this job: time_text_embed trains" in caplog.text
    assert [e["loss"] for e in plain if e["type"] == "step"] == [e["loss"] for e in offloaded if e["type"] == "step"]


def _onloaded_per_step(events: list[dict]) -> list[int]:
    """Weight bytes each step brought to the device: copied, or found still in their ring slot."""
    totals = [e["offload"]["h2d_bytes"] + e["offload"]["reused_bytes"] for e in events if e["type"] == "step"]
    return [after - before for before, after in itertools.pairwise(totals)]


def test_an_offloaded_job_with_the_table_trains_samples_and_saves_as_plain_training(roots, tmp_path: Path) -> None:
    _run(cache_job(), roots, tmp_path / "cache-job")
    offload = {"enable_model_cpu_offload": True, "prefetch": 2}
    plain = _run(train_job(sample=SAMPLE), roots, tmp_path / "plain")
    tabled = _run(train_job(offload=offload, sample=SAMPLE), roots, tmp_path / "tabled")  # the default
    streamed = _run(
        train_job(offload=offload, sample=SAMPLE, model={"precompute_modulation": False}), roots, tmp_path / "streamed"
    )
    losses = [[e["loss"] for e in run if e["type"] == "step"] for run in (plain, tabled, streamed)]
    assert losses[0] == losses[1] == losses[2] and len(losses[0]) == 4
    final = "checkpoints/step-00000004"
    adapters = [load_file(str(tmp_path / d / final / "pytorch_lora_weights.safetensors")) for d in ("plain", "tabled")]
    assert adapters[0].keys() == adapters[1].keys() and all(
        torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0]
    )
    for name in ("sample-00.png", "sample-01.png"):  # the samples' Euler steps read the table too
        assert (tmp_path / "plain" / final / name).read_bytes() == (tmp_path / "tabled" / final / name).read_bytes()
    # The engine streams every block less its two modulation layers: 2 x (32 x 192 + 192) float32 bytes per
    # block of the tiny DiT, in the forward and again in the backward.
    mod_bytes_per_pass = 2 * 2 * (32 * 192 + 192) * 4
    saved = [s - t for s, t in zip(_onloaded_per_step(streamed), _onloaded_per_step(tabled), strict=True)]
    samples_at_step_2 = 2 * 8  # two prompts, eight Euler steps, one forward each (no guidance)
    assert saved == [2 * mod_bytes_per_pass, (2 + samples_at_step_2) * mod_bytes_per_pass, 2 * mod_bytes_per_pass]


def test_precompute_modulation_is_refused_where_it_cannot_apply(roots) -> None:
    images = {"kind": "image_caption", "path": "images", "max_pixels": 64 * 48}
    problems = _problems(train_job("wan", data=images, model={"precompute_modulation": True}), roots)
    assert problems["model.precompute_modulation"].startswith(
        "only Qwen-Image's and Flux.1's DiTs have per-block modulation layers to precompute; got WanTransformer3DModel"
    )
    problems = _problems(train_job(data=images, lora=None, model={"precompute_modulation": True}), roots)
    assert problems["model.precompute_modulation"] == (
        "a full fine-tune trains img_mod.1 and txt_mod.1; the table needs them frozen (add a lora section); "
        "set it to false or leave it out"
    )


@pytest.mark.gpu
def test_on_a_gpu_a_batch_of_one_gets_bitwise_the_dits_own_loss_and_gradients() -> None:
    # cuBLAS picks its kernel by shape: the table's rows are computed with the shape a batch of one computes.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain = _lora_dit(torch.bfloat16).cuda()
    tabled = copy.deepcopy(plain).cpu()  # built as the job builds it: weights on the CPU, rows on the GPU
    table = precompute_modulation(tabled, SCHEDULE, torch.device("cuda"), contextlib.nullcontext)
    tabled.cuda()
    for seed in range(3):
        batch = {key: value.cuda() for key, value in _batch(1, seed).items()}
        want_loss, want = _loss_and_grads(plain, batch)
        rows = table.rows_for(batch["sigma"]).cuda()
        got_loss, got = _loss_and_grads(tabled, {**batch, "modulation": rows})
        assert torch.equal(want_loss, got_loss)
        assert want.keys() == got.keys() and all(torch.equal(want[name], got[name]) for name in want)
