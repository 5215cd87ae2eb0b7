"""Which model family a fine-tuning request's ``model`` is: a vision-language model trains as
``model.kind: hf_image_text_to_text``, any other as ``hf_causal_lm``.

Read from the directory's ``config.json`` alone (the API process imports no transformers): every
image-text-to-text architecture transformers loads with ``AutoModelForImageTextToText`` (Qwen2.5-VL and Qwen3-VL,
Idefics3 and SmolVLM, LLaVA, Gemma 3, Llama 3.2 Vision, PaliGemma) nests its vision encoder's settings under
``vision_config``; a text model has none. A directory that cannot be read is left to the spec check, which names it.
"""

from __future__ import annotations

import json
from pathlib import Path

from jobs.paths import confine


def is_image_text_model(model: str, roots: list[Path]) -> bool:
    """Whether ``model`` (a directory under one of ``roots``) holds a vision-language model's ``config.json``."""
    try:
        config = json.loads((confine(model, [r.resolve() for r in roots], "model") / "config.json").read_text())
    except (ValueError, OSError):  # missing, outside the roots, no JSON: the spec check says which
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)
