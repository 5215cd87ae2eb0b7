"""A model directory's ``config.json`` as a config `AutoModelForCausalLM` can build, or a one-line refusal.

transformers answers an architecture it does not build as a causal LM with every config class it does (3 KB and
more), and one it does not know at all with a paragraph about upgrading; a spec's problem is one line naming
``model.path``'s ``model_type`` and what to do, so these are caught here, before any model is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXAMPLES = "llama, qwen2, mistral, gemma, phi3"  # causal LMs Ferry's tests and configs train


def causal_lm_config(path: Path) -> Any:
    """``path``'s config, checked to be one `AutoModelForCausalLM` builds.

    Raises:
        ValueError: one line: no ``model_type``, one transformers does not know, or not a causal LM.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type, architectures = _declared(path)
    fix = f"point model.path at a decoder-only causal LM's directory (model_type e.g. {EXAMPLES})"
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except ValueError:
        if model_type is None:
            raise ValueError(f"{path.name}/config.json has no model_type; {fix}") from None
        raise ValueError(
            f"{path.name}/config.json: model_type {model_type!r} is not an architecture this transformers "
            f"knows (Ferry runs no remote code); {fix}, or upgrade transformers if it is newer"
        ) from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        named = f" ({', '.join(architectures)})" if architectures else ""
        raise ValueError(
            f"{path.name}/config.json: model_type {config.model_type!r}{named} is not a causal LM that "
            f"AutoModelForCausalLM builds; {fix}"
        )
    return config


def _declared(path: Path) -> tuple[str | None, list[str]]:
    """``model_type`` and ``architectures`` as the file writes them (for the message; AutoConfig checks)."""
    try:
        values = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None, []
    if not isinstance(values, dict):
        return None, []
    model_type = values.get("model_type")
    architectures = values.get("architectures")
    return (
        model_type if isinstance(model_type, str) else None,
        [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else [],
    )
