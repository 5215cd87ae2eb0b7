"""Prompt masks reach the DiT only where a prompt is padded, as QwenImagePipeline passes them: an all-ones mask
is dropped, so the DiT attends unmasked (the flash kernel, not the masked one), and the loss is the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from jobs.models.diffusion.data.batches import DiffusionBatches, padded_mask
from jobs.models.diffusion.flow_match import TrainingTimesteps
from jobs.models.diffusion.model import flow_loss
from jobs.models.diffusion.variants import FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore")
QWEN = FAMILIES["QwenImageTransformer2DModel"]


class _Prompts:
    """A SampleSource of one latent shape whose prompts have the given token counts."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def latent_shape(self, index: int) -> tuple[int, ...]:
        return (8, 8)

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.randn(16, 1, 8, 8, generator=generator), torch.randn(self.tokens[index], 16, generator=generator)


def _batch(tokens: list[int]) -> dict[str, torch.Tensor]:
    timesteps = TrainingTimesteps("qwen_image", (0.0, 1.0), "none")
    return DiffusionBatches(_Prompts(tokens), QWEN, timesteps, batch_size=len(tokens), seed=0).batch(0)


def test_a_mask_is_kept_only_where_a_prompt_is_padded() -> None:
    assert padded_mask(torch.ones(2, 5, dtype=torch.long)) is None
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert padded_mask(mask) is mask
    assert "prompt_mask" not in _batch([5, 5])  # the same length: nothing padded
    padded = _batch([5, 3])
    assert padded["prompt_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]


def _qwen() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    ).eval()  # fmt: skip


def test_an_unpadded_batch_reaches_the_dit_without_a_mask_and_trains_the_same() -> None:
    model = _qwen()
    seen: list[Any] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("encoder_hidden_states_mask")), with_kwargs=True
    )
    batch = _batch([5, 5])
    unmasked = flow_loss(model, batch)
    masked = flow_loss(model, {**batch, "prompt_mask": torch.ones(2, 5, dtype=torch.long)})
    assert seen[0] is None and seen[1] is not None
    torch.testing.assert_close(unmasked, masked)
    flow_loss(model, _batch([5, 3]))
    assert seen[2].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
