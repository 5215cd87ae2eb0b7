"""A DiT LoRA checkpoint as one ``.safetensors`` file in the layout ComfyUI's LoRA loader and diffusers' both read,
with the trigger word and the training settings in its header as kohya's and ai-toolkit's files carry them.

The checkpoint itself holds diffusers' layout (``transformer.<module>.lora_A.weight``, the scale in
diffusers' ``lora_adapter_metadata``), which ComfyUI does not read for every family, and which leaves the
scale out of the weights. The file written here:

- Qwen-Image: ``diffusion_model.<module>`` keys; ComfyUI's Qwen-Image model names its modules as diffusers does.
- Wan: ``diffusion_model.<module>`` in the original Wan names ComfyUI's model uses (``blocks.0.self_attn.q``
  for diffusers' ``blocks.0.attn1.to_q``): the names diffusers' own single-file converter reads.
- Flux.1: diffusers' ``transformer.<module>`` names, which ComfyUI maps onto its fused Flux weights itself.

Each module has ``lora_A.weight`` (down) and ``lora_B.weight`` (up) with the adapter's scale (peft's
``alpha / r``) already in ``lora_B``, so no ``alpha`` key: every loader applies ``B·A`` as it stands
(``ss_network_alpha`` equals ``ss_network_dim``, kohya's spelling of a scale of 1). The header holds
``ss_*`` keys as kohya's sd-scripts write them and ``modelspec.*`` keys of the SAI model spec, among them
``modelspec.trigger_phrase``.

Example:
    >>> write_lora_file(Path("out/dog/checkpoints/step-00000500"))
    PosixPath('out/dog/exports/step-00000500-lora.safetensors')
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import Any

import torch

from jobs.models.diffusion.model import LORA_WEIGHTS

# diffusers' Wan module names -> the original ones (ComfyUI's model), the inverse of diffusers'
# convert_wan_transformer_to_diffusers renames for the modules a LoRA can target (Linear layers).
_WAN_NAMES = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_out.0", ".o"),
    (".to_q", ".q"),
    (".to_k", ".k"),
    (".to_v", ".v"),
    (".add_k_proj", ".k_img"),
    (".add_v_proj", ".v_img"),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
)
# Which families this file is written for, and kohya's / the SAI model spec's name for each base.
BASE_MODELS = {"qwen_image": "qwen_image", "wan": "wan", "flux1": "flux1"}
ARCHITECTURES = {"qwen_image": "qwen-image/lora", "wan": "wan-2.1/lora", "flux1": "flux-1-dev/lora"}


def wan_module_name(diffusers_name: str) -> str:
    """``blocks.0.attn1.to_q`` -> ``blocks.0.self_attn.q``: a Wan module's name in the original checkpoints."""
    name = f".{diffusers_name}"
    for old, new in _WAN_NAMES:
        name = name.replace(old, new)
    return name[1:]


def comfyui_key(family: str, module: str) -> str:
    """The key prefix ComfyUI reads for the diffusers module ``module`` of ``family``."""
    if family == "flux1":
        return f"transformer.{module}"
    return f"diffusion_model.{wan_module_name(module) if family == 'wan' else module}"


def write_lora_file(checkpoint: Path, output: Path | None = None) -> Path:
    """Write the LoRA of a diffusion checkpoint as one ComfyUI/diffusers ``.safetensors`` with its metadata.

    Args:
        checkpoint: A Ferry checkpoint of a LoRA job on a ``diffusers_transformer`` model.
        output: Default ``<output_dir>/exports/<checkpoint>-lora.safetensors``.

    Returns:
        The file written (atomically: it appears whole or not at all).

    Raises:
        ValueError: not such a checkpoint, or a family this layout is not written for (Flux.2).
    """
    from safetensors.torch import load_file, save_file

    from jobs.checkpoints.directory import EXPORTS_DIR
    from jobs.models.diffusion.variants import family_of

    checkpoint = Path(checkpoint)
    manifest, spec = _read_manifest(checkpoint)
    family = family_of(Path(spec["model"]["path"])).name
    if family not in BASE_MODELS:
        raise ValueError(
            f"a {family} LoRA is written in diffusers' layout only (its checkpoint's {LORA_WEIGHTS}, which "
            f"diffusers' load_lora_weights reads); choose a family of {', '.join(BASE_MODELS)} for this file"
        )
    state = load_file(str(checkpoint / LORA_WEIGHTS))
    rank, scale = _rank_and_scale(checkpoint / LORA_WEIGHTS)
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in sorted(state.items()):
        module, _, part = key.removeprefix("transformer.").rpartition(".lora_")
        # The scale goes into lora_B: a loader without an alpha applies B·A as it is (ComfyUI: alpha None is
        # 1; diffusers: lora_alpha = rank), and diffusers' Wan reader leaves the alphas of modules outside
        # the blocks unread, refusing the file.
        tensors[f"{comfyui_key(family, module)}.lora_{part}"] = (
            tensor * scale if part == "B.weight" else tensor
        ).contiguous()
    output = Path(output) if output else checkpoint.parent.parent / EXPORTS_DIR / f"{checkpoint.name}-lora.safetensors"
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".tmp-{output.name}-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, str(tmp), metadata=lora_metadata(spec, manifest, family, rank, rank))
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    return output


def lora_metadata(
    spec: dict[str, Any], manifest: dict[str, Any], family: str, rank: int, alpha: float
) -> dict[str, str]:
    """The header's text: kohya's ``ss_*`` keys and the SAI model spec's ``modelspec.*`` (all strings)."""
    data, training = spec.get("data", {}), spec.get("training", {})
    trigger = data.get("trigger_word") or ""
    meta = {
        "format": "pt",
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": f"{alpha:g}",
        "ss_base_model_version": BASE_MODELS[family],
        "ss_output_name": spec.get("name", ""),
        "ss_max_train_steps": str(manifest.get("step", training.get("steps") or "")),
        "ss_learning_rate": str(training.get("learning_rate", "")),
        "ss_optimizer": str(training.get("optimizer", "")),
        "ss_seed": str(training.get("seed", "")),
        "ss_training_comment": f"trigger word: {trigger}" if trigger else "",
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": ARCHITECTURES[family],
        "modelspec.implementation": "https://github.com/huggingface/diffusers",
        "modelspec.title": spec.get("name", ""),
        "modelspec.trigger_phrase": trigger,
        "modelspec.date": str(manifest.get("created", "")),
        "modelspec.prediction_type": "flow",
        "ferry_spec": json.dumps(spec, sort_keys=True, default=str),
    }
    return {key: value for key, value in meta.items() if value != ""}


def _read_manifest(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    if checkpoint.name.startswith(".tmp-"):
        raise ValueError(f"{checkpoint} is a checkpoint still being written; export it once it is saved")
    try:
        manifest: dict[str, Any] = json.loads((checkpoint / "manifest.json").read_text())
    except (OSError, ValueError):
        raise ValueError(f"{checkpoint} is not a Ferry checkpoint (no readable manifest.json)") from None
    spec = manifest.get("spec", {})
    if spec.get("model", {}).get("kind") != "diffusers_transformer" or not (checkpoint / LORA_WEIGHTS).is_file():
        raise ValueError(
            f"{checkpoint} is not a LoRA checkpoint of a diffusers_transformer model (no {LORA_WEIGHTS}); "
            "a LoRA file is written from one"
        )
    return manifest, spec


def _rank_and_scale(weights: Path) -> tuple[int, float]:
    """The adapter's rank and the factor its product is scaled by (peft's ``alpha / r``, ``/ sqrt(r)`` for
    rsLoRA), from the peft config diffusers' ``save_lora_weights`` put in the file's header."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as handle:
        saved = json.loads((handle.metadata() or {}).get("lora_adapter_metadata", "{}"))
    config = {key.removeprefix("transformer."): value for key, value in saved.items()}  # diffusers prefixes them
    rank = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", rank))
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
