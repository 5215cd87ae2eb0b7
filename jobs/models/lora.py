"""LoRA through peft: the adapters added to a built model (their files: jobs/checkpoints/adapter.py)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

if TYPE_CHECKING:
    from jobs.spec.job import LoraSpec


def apply_lora(model: nn.Module, spec: LoraSpec, *, task_type: str | None) -> PeftModel:
    """Freeze ``model`` and wrap it with LoRA adapters on ``spec.target_modules``.

    Args:
        model: The CPU base model.
        spec: The lora section.
        task_type: peft's task type from the model family (``CAUSAL_LM`` lets AutoPeftModelForCausalLM
            load the adapter), or None.
    """
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha or spec.rank,  # type: ignore[arg-type]  # peft scales by alpha / r: a float works
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        use_dora=spec.use_dora,
        use_rslora=spec.use_rslora,
        modules_to_save=list(spec.modules_to_save) or None,
        init_lora_weights=spec.init_lora_weights,
        task_type=task_type,
    )
    return get_peft_model(model, config)


def no_upcast_under_autocast(model: nn.Module) -> None:
    """Each LoRA layer leaves its input in its own dtype while autocast is on.

    peft casts a layer's input to the adapter's dtype before ``lora_A``, and adapters are float32 on a bf16
    base (``keep_trainable_in_float32``, peft's ``autocast_adapter_dtype``). Under autocast that float32 copy
    of the activation (batch x tokens x in_features, 4 bytes an element) is cast straight back to bf16 by the
    matmul: two full-width copies per layer per pass for bitwise the same product. Without autocast the cast
    stays (float32 adapters need float32 inputs). Plain LoRA linears only: a variant (DoRA) computes more than
    the two matmuls from the input.
    """
    from peft.tuners.lora.layer import Linear

    for module in model.modules():
        if isinstance(module, Linear) and not module.lora_variant:
            module._cast_input_dtype = functools.partial(_cast_input_unless_autocast, module)  # type: ignore[method-assign,assignment]


def _cast_input_unless_autocast(layer: nn.Module, x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if x is not None and torch.is_autocast_enabled(x.device.type):
        return x  # autocast casts x and the weight to its dtype for the matmul itself
    return type(layer)._cast_input_dtype(layer, x, dtype)  # type: ignore[attr-defined]


@contextlib.contextmanager
def adapters_stay_on_the_cpu(model: nn.Module) -> Iterator[None]:
    """While peft adds adapters to ``model`` whose base weights are on the meta device, keep them on the CPU.

    peft moves each new adapter to its base layer's device; for a meta base (weights not loaded yet: the
    offload engine fills them straight into pinned memory) that would discard the adapters' initial values.
    Inside this block each meta weight is a CPU stand-in of the same shape and dtype backed by one element
    (an expanded scalar), so peft creates, initializes and places the adapters exactly as for a model built
    in memory (same values, drawn in the same order); the meta weights come back after.
    """
    swapped = []
    for param in model.parameters():
        if param.is_meta:
            stand_in = nn.Parameter(torch.zeros((), dtype=param.dtype).expand(param.shape), param.requires_grad)
            torch.utils.swap_tensors(param, stand_in)
            swapped.append((param, stand_in))
    try:
        yield
    finally:
        for param, stand_in in swapped:
            torch.utils.swap_tensors(param, stand_in)
            param.requires_grad_(stand_in.requires_grad)  # peft froze the base while the stand-in was in place
