"""Checkpoints that load without Ferry: ``save_pretrained`` for full fine-tunes, merged LoRA models, archives.

A full fine-tune of a Hugging Face model is saved as ``save_pretrained`` writes it (``config.json``,
``generation_config.json``, ``model.safetensors``) with the tokenizer beside it, so
``AutoModelForCausalLM.from_pretrained(checkpoint_dir)`` loads it. A LoRA checkpoint is merged into its
base model with peft's ``merge_and_unload`` into a directory of the same shape (the weights in shards of
at most 5 GB with ``model.safetensors.index.json``, as the Hub's models are; ``generation_config.json``
stopping at the chat template's end-of-turn token too), and packed into one archive for download.

A QLoRA adapter (``model.quantize: nf4`` or ``int8``) was trained against the quantized base, so it is
merged into that: the base quantized as training quantized it, dequantized into bf16, the adapter added.
The merged model is bf16 and says so in its ``README.md``.
"""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobs.checkpoints.directory import EXPORTS_DIR, is_mergeable
from jobs.checkpoints.weights import WeightsFormat, is_peft_model, load_trainable

log = logging.getLogger(__name__)
MAX_SHARD_SIZE = "5GB"  # what the Hub's models use: a shard per download, within any file system's limits
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def save_pretrained_full(model: nn.Module, directory: Path) -> None:
    """Write a full Hugging Face model with ``save_pretrained`` from CPU copies of its current weights.

    The offload engine may hold weights on the device or in pinned buffers; the state dict handed over
    is read from wherever they are now (a device-to-host copy: a sync point).
    """
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in model.state_dict().items()}
    hf_model: Any = model  # a transformers PreTrainedModel (config, save_pretrained)
    use_cache = hf_model.config.use_cache
    hf_model.config.use_cache = True  # off for training (jobs/models/hf_causal_lm.py); on for whoever loads it
    try:
        hf_model.save_pretrained(str(directory), state_dict=state)
    finally:
        hf_model.config.use_cache = use_cache


def save_hf_checkpoint(model: nn.Module, directory: Path) -> None:
    """A Hugging Face model's checkpoint: its LoRA adapter in peft's layout, or the whole model pretrained-style."""
    if is_peft_model(model):
        from jobs.checkpoints.adapter import save_adapter

        save_adapter(model, directory)
    else:
        save_pretrained_full(model, directory)


# Written as Hugging Face loads it; read back (resume) by the same loader as trainable safetensors, since
# save_pretrained names the tensors as the model's state dict does.
HF_PRETRAINED = WeightsFormat("hf_pretrained", save_hf_checkpoint, load_trainable)


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """The job's Hugging Face tokenizer (with a chat template given in the spec) beside the weights."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        hf.save_pretrained(str(directory))


def merge_lora_checkpoint(
    checkpoint: Path, output: Path | None = None, *, archive: bool = True, max_shard_size: str | int = MAX_SHARD_SIZE
) -> Path:
    """Merge the LoRA adapter of ``checkpoint`` into its base model and save the result as a full model.

    Args:
        checkpoint: A checkpoint directory of a LoRA job on an ``hf_causal_lm`` model.
        output: Where the merged model goes; default: ``<output_dir>/exports/<checkpoint>-merged``.
        archive: Also write ``<output>.tar`` (one file to download).
        max_shard_size: The largest safetensors file (``"5GB"``, or bytes); a larger model is written in
            shards with ``model.safetensors.index.json``.

    Returns:
        The merged model's directory (``AutoModelForCausalLM.from_pretrained`` loads it).

    Raises:
        ValueError: not a LoRA checkpoint of a Hugging Face model, or its base model is gone.

    Example:
        >>> merge_lora_checkpoint(Path("out/chat/checkpoints/step-00000100"))
        PosixPath('out/chat/exports/step-00000100-merged')
    """
    from peft import PeftModel

    checkpoint = Path(checkpoint)
    spec = _lora_spec(checkpoint)
    check_finite_weights(checkpoint)
    base_path = Path(spec["model"]["path"])
    if not (base_path / "config.json").is_file():
        raise ValueError(f"the base model {base_path} of {checkpoint} is gone; it is needed to merge the adapter")
    output = Path(output) if output else checkpoint.parent.parent / EXPORTS_DIR / f"{checkpoint.name}-merged"
    method = spec["model"].get("quantize")
    base = _base_as_trained(base_path, spec["model"].get("dtype", "float32"), method)
    merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()
    tmp = output.with_name(f".tmp-{output.name}-{uuid.uuid4().hex[:8]}")
    try:
        merged.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        _copy_tokenizer(checkpoint, base_path, spec, tmp)
        add_stop_tokens(tmp)
        _write_readme(tmp, output.name, checkpoint, base_path, method)
        if output.exists():
            shutil.rmtree(output)
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if archive:
        archive_directory(output)
    log.info("merged %s into %s%s", checkpoint, output, f" (its {method} base dequantized into bf16)" if method else "")
    return output


def _base_as_trained(base_path: Path, dtype: str, method: str | None) -> nn.Module:
    """The base model as the adapter saw it: in the spec's dtype, or quantized with ``method`` and dequantized
    into bf16 (the same torchao quantizer training used, on the same weights: the same codes)."""
    from transformers import AutoModelForCausalLM

    base: Any = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=getattr(torch, dtype), local_files_only=True)
    if method is None:
        return base
    from offload.quant.int8_linear import dequantize as int8_dequantize
    from offload.quant.nf4_linear import dequantize as nf4_dequantize
    from offload.quant.quantized import quantizable, quantizer

    quantize, dequantize = quantizer(method), nf4_dequantize if method == "nf4" else int8_dequantize
    base.requires_grad_(False)  # as under the adapter: every base weight frozen, so quantizable picks the same
    for module in base.modules():
        if quantizable(module, method):
            # A new parameter, as training's quantization made one: a weight tied to the embedding (a tied
            # lm_head) leaves the embedding unquantized, as it trained.
            weight = dequantize(quantize(module.weight.detach().contiguous()), torch.bfloat16)
            module.weight = nn.Parameter(weight, requires_grad=False)
    return base.to(torch.bfloat16)


def add_stop_tokens(model_dir: Path) -> None:
    """Make ``generation_config.json`` stop where the chat template ends a turn (``<|im_end|>``, ``<|eot_id|>``)
    as well as at the model's EOS: ``generate`` and vLLM read these ids, so a chat reply ends there.

    Nothing changes without a tokenizer or a chat template Ferry knows (`ollama_modelfile.FORMATS`).
    """
    from transformers import AutoTokenizer, GenerationConfig

    from jobs.checkpoints.ollama_modelfile import map_chat_template, stop_tokens

    if not (model_dir / "tokenizer_config.json").is_file():
        return
    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
    stops = stop_tokens(tokenizer, model_dir, map_chat_template(tokenizer).format)
    ids = [i for i in tokenizer.convert_tokens_to_ids(stops) if i is not None and i != tokenizer.unk_token_id]
    config = GenerationConfig.from_pretrained(str(model_dir))
    eos = config.eos_token_id
    known = eos if isinstance(eos, list) else [eos] if eos is not None else []
    config.eos_token_id = list(dict.fromkeys([*known, *ids]))
    if config.pad_token_id is None and tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(str(model_dir))


def _write_readme(model_dir: Path, name: str, checkpoint: Path, base_path: Path, method: str | None) -> None:
    """A model card: what was merged into what, and the precision of the result."""
    config = json.loads((model_dir / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "the base's dtype"
    lines = [
        f"# {checkpoint.name} merged",
        "",
        f"The LoRA adapter of Ferry checkpoint `{checkpoint.name}` merged into its base model `{base_path.name}` "
        f"(peft's `merge_and_unload`); weights in {dtype}.",
    ]
    if method is not None:
        lines += [
            "",
            f"The adapter was trained on the base quantized to {method} (QLoRA). It is merged into that base "
            f"dequantized into bf16: the weights the adapter learned against, not the original {base_path.name} "
            "weights, so this model computes as the trained one did, within bf16 rounding.",
        ]
    lines += ["", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("{name}")', f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
              "```", ""]  # fmt: skip
    (model_dir / "README.md").write_text("\n".join(lines))


def merge_note(spec: dict[str, Any]) -> str | None:
    """What a merged export says of its precision: None, or that a quantized base was dequantized into bf16."""
    method = spec.get("model", {}).get("quantize")
    if method is None:
        return None
    return f"the adapter was trained on a {method} base: merged into that base dequantized into bf16 (a bf16 model)"


def check_finite_weights(checkpoint: Path) -> None:
    """Refuse a checkpoint whose saved weights hold NaN or infinity: a diverged run, which no program can use.

    Each ``.safetensors`` file of the checkpoint is read one tensor at a time (the host memory of the largest
    tensor, not of the model).

    Raises:
        ValueError: naming the first tensor that is not finite and the fix (an earlier checkpoint).
    """
    from safetensors import safe_open

    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        try:
            weights = safe_open(str(path), framework="pt")
        except Exception:  # not safetensors at all: the exporter's own reading says what is wrong with it
            continue
        with weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not iterable)
                tensor = weights.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise ValueError(
                        f"checkpoint {Path(checkpoint).name} has weights that are not finite ({name} in {path.name} "
                        "holds NaN or infinity: the run diverged); export an earlier checkpoint, or train again "
                        "with a lower training.learning_rate"
                    )


def archive_directory(directory: Path) -> Path:
    """``<directory>.tar`` holding the directory's files (uncompressed: weights do not compress)."""
    target = directory.with_name(directory.name + ".tar")
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    with tarfile.open(tmp, "w") as tar:
        for path in sorted(directory.iterdir()):
            tar.add(path, arcname=f"{directory.name}/{path.name}")
    tmp.rename(target)  # a reader sees no archive or a complete one
    return target


def _lora_spec(checkpoint: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((checkpoint / "manifest.json").read_text())
    except (OSError, ValueError):
        raise ValueError(f"{checkpoint} is not a Ferry checkpoint (no readable manifest.json)") from None
    spec = manifest["spec"]
    names = [path.name for path in checkpoint.iterdir()]
    if not is_mergeable(names, spec.get("model", {}).get("kind")):
        raise ValueError(
            f"{checkpoint} is not a LoRA checkpoint of an hf_causal_lm model; only those can be merged "
            "(a full fine-tune's checkpoint is already a whole model)"
        )
    return spec


def _copy_tokenizer(checkpoint: Path, base_path: Path, spec: dict[str, Any], target: Path) -> None:
    """The tokenizer saved with the checkpoint, else the spec's tokenizer directory."""
    tokenizer = spec.get("data", {}).get("tokenizer", {})
    source = checkpoint if (checkpoint / "tokenizer_config.json").is_file() else Path(tokenizer.get("path", base_path))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
