"""LoRA through peft, saved the way peft and transformers load it (adapter_model.safetensors + config)."""

from __future__ import annotations

from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn

from jobs.spec import LoraSpec

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


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


def save_adapter(model: PeftModel, directory: Path) -> None:
    """Write the adapter weights and config into ``directory`` (CPU copies; the model may be offloaded)."""
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in get_peft_model_state_dict(model).items()}
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(directory))


def load_adapter(model: PeftModel, directory: Path) -> None:
    """Load adapter weights saved by `save_adapter` into ``model`` (before the offload engine attaches)."""
    result = set_peft_model_state_dict(model, load_file(str(directory / ADAPTER_WEIGHTS)))
    unexpected = list(result.unexpected_keys)  # type: ignore[attr-defined]  # torch's _IncompatibleKeys
    if unexpected:
        raise ValueError(f"checkpoint {directory} has adapter weights this model lacks: {unexpected[:5]}")
