"""The DiT's block checkpointing: the gradients of training without it, with far less host work."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from jobs import run_job
from jobs.models.diffusion.model import LORA_WEIGHTS, apply_dit_lora, enable_dit_checkpointing, flow_loss
from jobs.recompute import apply_activation_checkpointing
from jobs.recompute.checkpoint import checkpoint_block
from tests.jobs.helpers import losses_and_saved, python_calls
from tests.jobs.models.diffusion.helpers import QWEN_TARGETS, WAN_TARGETS, cache_job, spec_from, train_job

pytestmark = pytest.mark.filterwarnings("ignore")


def _qwen(layers: int) -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=layers, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    )  # fmt: skip


def _wan(layers: int) -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=16, num_layers=layers, rope_max_seq_len=32,
    )  # fmt: skip


def _batch(frames: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, frames, 8, 8, generator=generator)
    return {
        "latents": latents,
        "noise": torch.randn(latents.shape, generator=generator),
        "sigma": torch.tensor([0.3, 0.8]),
        "prompt_embeds": torch.randn(2, 5, 16, generator=generator),
        "prompt_mask": torch.ones(2, 5, dtype=torch.long),
        "weight": torch.ones(2),
    }


def _lora_dit(
    build: Callable[[int], nn.Module], targets: list[str], layers: int, checkpointing: bool, dropout: float = 0.0
) -> nn.Module:
    lora = SimpleNamespace(rank=4, alpha=None, dropout=dropout, target_modules=targets)
    model = apply_dit_lora(build(layers), lora)
    if checkpointing:
        enable_dit_checkpointing(model)  # diffusers' own switch, then Ferry's checkpoint as the trainer applies it
        apply_activation_checkpointing(model)
    return model.train()


def _gradients(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    flow_loss(model, batch).backward()
    return {name: param.grad for name, param in model.named_parameters() if param.requires_grad}


@pytest.mark.parametrize(
    ("build", "targets", "frames"), [(_qwen, QWEN_TARGETS, 1), (_wan, WAN_TARGETS, 2)], ids=["qwen", "wan"]
)
def test_checkpointed_lora_gradients_equal_the_plain_ones_bitwise(build, targets, frames) -> None:
    # The adapters sit in the blocks and the patch embedding is frozen, so the first block's input needs no
    # gradient: the reentrant checkpoint would leave every adapter without one unless that input gets
    # requires_grad.
    # LoRA dropout: the recompute must draw the forward's masks.
    batch = _batch(frames)
    plain = _gradients(_lora_dit(build, targets, 3, checkpointing=False, dropout=0.1), batch)
    checkpointed = _gradients(_lora_dit(build, targets, 3, checkpointing=True, dropout=0.1), batch)
    assert plain.keys() == checkpointed.keys()
    assert sum(grad is not None for grad in checkpointed.values()) > 20
    for name, grad in plain.items():
        # A Qwen-Image block's text-side adapters in the last block get none: its text output is dropped.
        assert (grad is None) == (checkpointed[name] is None), name
        assert grad is None or torch.equal(grad, checkpointed[name]), name


def test_a_checkpointed_lora_job_trains_and_saves_exactly_as_one_without(roots, tmp_path: Path) -> None:
    # With the engine too: the offloaded job recomputes each block under the engine's saved-tensor hooks.
    assert run_job(spec_from(cache_job(), roots), output_dir=tmp_path / "cache").status == "succeeded"
    runs = {
        "plain": train_job(training={"steps": 3, "weight_decay": 0.01, "gradient_checkpointing": False}),
        "checkpointed": train_job(training={"steps": 3, "weight_decay": 0.01}),
        "offloaded": train_job(training={"steps": 3, "weight_decay": 0.01}, offload={"enable_model_cpu_offload": True}),
    }
    losses, weights = {}, {}
    for name, job in runs.items():
        losses[name], weights[name] = losses_and_saved(spec_from(job, roots), tmp_path / name, LORA_WEIGHTS)
    for name in ("checkpointed", "offloaded"):
        assert losses[name] == losses["plain"] and len(losses[name]) == 3, name
        # Every saved adapter, also the last block's text-side ones that get no gradient (its text output is
        # dropped): torch's own reentrant checkpoint would hand them zeros, and AdamW would decay them.
        assert weights[name].keys() == weights["plain"].keys(), name
        assert all(torch.equal(weights[name][k], weights["plain"][k]) for k in weights["plain"]), name


def test_checkpointing_adds_little_host_work_to_a_training_step() -> None:
    # The H200's DiT step is bound by the host issuing kernels, so Python calls are step time. Recomputing
    # the blocks' forward costs its calls once more: 1.41x the calls of the same step without checkpointing
    # here. torch's non-reentrant checkpoint (diffusers' default) also runs hooks for every tensor a block
    # saves: 2.85x.
    batch = _batch()
    plain, checkpointed = (_lora_dit(_qwen, QWEN_TARGETS, 6, checkpointing=flag) for flag in (False, True))
    _gradients(plain, batch), _gradients(checkpointed, batch)  # warm up: first-call imports and caches
    ratio = python_calls(lambda: _gradients(checkpointed, batch)) / python_calls(lambda: _gradients(plain, batch))
    assert ratio < 1.6, ratio


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x) * (1.0 if scale is None else scale)


def test_keyword_arguments_fall_back_to_the_non_reentrant_checkpoint() -> None:
    block, x = _Block(), torch.randn(2, 4)
    checkpoint_block(block, x, scale=torch.tensor(2.0)).sum().backward()
    assert block.linear.weight.grad is not None
    expected = torch.autograd.grad((block.linear(x) * 2.0).sum(), block.linear.weight)[0]
    assert torch.equal(block.linear.weight.grad, expected)


def test_a_frozen_block_with_inputs_needing_no_gradient_is_left_without_one() -> None:
    block = _Block().requires_grad_(False)
    x = torch.randn(2, 4)
    out = checkpoint_block(block, x)
    assert not out.requires_grad and not x.requires_grad  # nothing trains: no backward through it
    trainable = _Block()
    out = checkpoint_block(trainable, x)
    assert out.requires_grad and not x.requires_grad  # the caller's tensor is not changed


@pytest.mark.gpu
def test_checkpointed_lora_gradients_equal_the_plain_ones_on_a_gpu() -> None:
    # On CUDA the recompute restores the device's random state too (dropout draws the forward's mask).
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch = {key: value.cuda() for key, value in _batch().items()}
    grads = []
    for checkpointing in (False, True):
        model = _lora_dit(_qwen, QWEN_TARGETS, 3, checkpointing, dropout=0.1).cuda()
        torch.manual_seed(3)
        grads.append(_gradients(model, batch))
    assert sum(grad is not None for grad in grads[1].values()) > 20
    for name, grad in grads[0].items():
        assert (grad is None) == (grads[1][name] is None), name
        if grad is not None:
            torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
