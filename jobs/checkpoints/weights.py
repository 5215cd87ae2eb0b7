"""Trainable weights in a checkpoint: LoRA adapters via peft, or every trainable tensor as safetensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

from safetensors.torch import load_file, save_file
from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel

MODEL_WEIGHTS = "model.safetensors"


def is_peft_model(model: nn.Module) -> TypeGuard[PeftModel]:
    """A peft-wrapped model (checked without importing peft)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def save_trainable(model: nn.Module, directory: Path) -> None:
    """Write the trainable weights of ``model`` into ``directory``.

    Only trainable tensors are saved: frozen weights come from the model source (a seed or files) and a
    multi-billion-parameter base model would otherwise be copied into every checkpoint.
    """
    if is_peft_model(model):
        from jobs.checkpoints.adapter import save_adapter  # peft is slow to import; only LoRA jobs need it

        save_adapter(model, directory)
        return
    # .to("cpu") is a device-to-host copy (a sync point) for weights the engine keeps on the device.
    state = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters() if p.requires_grad}
    save_file(state, str(directory / MODEL_WEIGHTS), metadata={"format": "pt"})


def load_trainable(model: nn.Module, directory: Path) -> None:
    """Load weights written by `save_trainable` into a freshly built CPU model."""
    if is_peft_model(model):
        from jobs.checkpoints.adapter import load_adapter

        load_adapter(model, directory)
        return
    state = load_file(str(directory / MODEL_WEIGHTS))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(state) != trainable:
        raise ValueError(
            f"checkpoint {directory} does not match the model: missing "
            f"{sorted(trainable - set(state))[:5]}, unexpected {sorted(set(state) - trainable)[:5]}"
        )
    model.load_state_dict(state, strict=False)


@dataclass(frozen=True)
class WeightsFormat:
    """How a model family writes its trainable weights into a checkpoint directory and reads them back.

    Attributes:
        name: Shown in docs and logs, e.g. ``trainable_safetensors``.
        save: ``save(model, directory)``; runs while the engine may hold the weights (copy to the CPU).
        load: ``load(model, directory)`` into a freshly built CPU model, before the engine attaches.
    """

    name: str
    save: Callable[[nn.Module, Path], None]
    load: Callable[[nn.Module, Path], None]


# LoRA adapters in peft's layout, else every trainable tensor in one model.safetensors.
TRAINABLE_SAFETENSORS = WeightsFormat("trainable_safetensors", save_trainable, load_trainable)
