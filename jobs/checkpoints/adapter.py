"""A LoRA adapter's files, written the way peft and transformers load them (adapter_model.safetensors + config)."""

from __future__ import annotations

import json
from pathlib import Path

from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def save_adapter(model: PeftModel, directory: Path) -> None:
    """Write the adapter weights and config into ``directory`` (CPU copies; the model may be offloaded)."""
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in get_peft_model_state_dict(model).items()}
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(directory))
    _name_base_model_portably(directory / ADAPTER_CONFIG)


def _name_base_model_portably(config_file: Path) -> None:
    """``base_model_name_or_path`` as the base model's directory name (``Qwen2.5-0.5B-Instruct``), not this
    machine's absolute path: the adapter loads wherever a directory of that name (or a hub id) is found.
    The full path stays in Ferry's own ``manifest.json`` (its spec's ``model.path``), which merging reads."""
    config = json.loads(config_file.read_text())
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and Path(base).is_absolute():
        config["base_model_name_or_path"] = Path(base).name
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def load_adapter(model: PeftModel, directory: Path) -> None:
    """Load adapter weights saved by `save_adapter` into ``model`` (before the offload engine attaches)."""
    result = set_peft_model_state_dict(model, load_file(str(directory / ADAPTER_WEIGHTS)))
    unexpected = list(result.unexpected_keys)  # type: ignore[attr-defined]  # torch's _IncompatibleKeys
    if unexpected:
        raise ValueError(f"checkpoint {directory} has adapter weights this model lacks: {unexpected[:5]}")
