"""LoRA layers under autocast: no float32 copy of the activation, bitwise the same products and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from jobs.models.lora import apply_lora, no_upcast_under_autocast
from jobs.spec.job import LoraSpec
from jobs.train.session import keep_trainable_in_float32

WIDTH, TOKENS = 48, 40


class _Casts(TorchDispatchMode):
    """Records each float32 tensor of the activation's size that a dtype conversion writes."""

    def __init__(self) -> None:
        super().__init__()
        self.upcasts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        converts = func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)
        if converts and isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() == TOKENS * WIDTH:
            self.upcasts += 1
        return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH, bias=False)
        self.down = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _adapted(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = apply_lora(
        _Block().to(torch.bfloat16),
        LoraSpec(target_modules=["up", "down"], rank=4, dropout=dropout, init_lora_weights="gaussian"),
        task_type=None,
    )
    keep_trainable_in_float32(model)  # float32 adapters on a bf16 base, as a mixed-precision job has them
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param)  # nonzero, so the adapters' gradients flow back through lora_A
    return model


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    with _Casts() as casts, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        (out * out).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    return out, grads, casts.upcasts


def test_under_autocast_the_input_is_not_upcast_and_the_results_are_bitwise_peft_own() -> None:
    x = torch.randn(2, TOKENS // 2, WIDTH).to(torch.bfloat16)
    reference = _adapted()
    expected, expected_grads, peft_upcasts = _run(reference, x)
    assert peft_upcasts >= 2  # peft's own path: a float32 copy of each layer's input

    model = _adapted()
    no_upcast_under_autocast(model)
    out, grads, upcasts = _run(model, x)
    assert upcasts == 0
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_without_autocast_float32_adapters_still_get_float32_inputs() -> None:
    model = _adapted()
    no_upcast_under_autocast(model)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, WIDTH).to(torch.bfloat16)
    for module in reference.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
    with pytest.raises(RuntimeError):  # the cast is what makes peft's path work without autocast
        reference(x)
    assert model(x).dtype == torch.bfloat16
