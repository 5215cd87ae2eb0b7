"""Building, adapting and checkpointing an image-text-to-text model: the vision tower found and frozen, LoRA on the
language model only, the loss the model computes from its labels.

The offload engine streams the language decoder's layers one by one (each layer a unit with
``offload.granularity: block``) and the vision tower as one unit of its own (`vision_tower_name`, given to
the engine as a whole unit): the tower runs once per step, in forward only when frozen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from jobs.checkpoints.export import save_hf_checkpoint
from jobs.checkpoints.weights import WeightsFormat, is_peft_model
from jobs.models.decoder_activations import DecoderDims, decoder_activation_bytes
from jobs.models.family import lora_target_matches
from jobs.models.loading.hf_checkpoint import checkpoint_problems, checkpoint_source
from jobs.models.loading.weight_sources import RandomSource, WeightSource

if TYPE_CHECKING:
    from jobs.models.vlm.spec import HFImageTextToTextSpec
    from jobs.spec.job import JobSpec, LoraSpec

VISION_TOWERS = ("visual", "vision_tower", "vision_model")  # Qwen-VL's, LLaVA's and Gemma 3's, Idefics3's
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def image_text_config(path: Path) -> Any:
    """``path``'s config, checked to be one ``AutoModelForImageTextToText`` builds.

    Raises:
        ValueError: one line naming ``model_type`` and the fix.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    fix = "point model.path at an image-text-to-text model's directory (model_type e.g. qwen2_5_vl, idefics3, llava)"
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise ValueError(f"model.path {path.name}: {type(error).__name__}: {error}; {fix}") from None
    if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        raise ValueError(f"{path.name}/config.json: model_type {config.model_type!r} is not an image-text model; {fix}")
    return config


def build_image_text_model(spec: HFImageTextToTextSpec, seed: int) -> nn.Module:
    """Load ``spec.path`` on the CPU in the spec's dtype, the vision tower frozen unless ``train_vision_tower``."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    if spec.init == "random":
        # transformers' own init of a 7B VLM ran for minutes of CPU (its per-module normal_); the values are drawn
        # as the offloaded build's RandomSource draws them instead (N(0, initializer_range), norms one, biases zero).
        from transformers.initialization import no_init_weights

        config = image_text_config(Path(spec.path))
        with no_init_weights():
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        model.tie_weights()
        source = RandomSource(model, seed, _initializer_range(config), torch.device("cpu"))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                source.fill(name, parameter, parameter.data)
        torch.manual_seed(seed)  # what is drawn next (LoRA's adapters) as the offloaded build draws it
    else:
        image_text_config(Path(spec.path))  # a one-line refusal before transformers' long one
        model = AutoModelForImageTextToText.from_pretrained(
            str(spec.path), dtype=dtype, local_files_only=True, trust_remote_code=False
        )
    _no_cache(model.config)
    vision_tower(model).requires_grad_(spec.train_vision_tower)
    return model


def build_image_text_model_on_meta(
    spec: HFImageTextToTextSpec, seed: int, device: torch.device
) -> tuple[nn.Module, WeightSource]:
    """Weights on the meta device, buffers (rotary frequencies) real, frozen as `build_image_text_model` freezes
    them; filled by the safetensors of ``spec.path``, their keys renamed as ``from_pretrained`` renames them
    (transformers' conversion mapping: Qwen2.5-VL's stored ``model.layers.*`` is ``model.language_model.layers.*``,
    jobs/models/loading/hf_checkpoint.py), or, with ``init: random``, by seeded random values drawn on ``device``.

    transformers' own weight init never runs (``no_init_weights``): on a 7B model it takes minutes of CPU for
    values the source overwrites. A checkpoint whose names the renamings do not place loads whole with
    ``from_pretrained`` instead, with a warning (`checkpoint_source`'s ``unmapped_loads_whole``)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    config = image_text_config(Path(spec.path))
    torch.manual_seed(seed)  # as the in-memory build seeds: LoRA's adapters, drawn next, are the same
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, spec.dtype))
    model.tie_weights()  # a tied head is one tensor: one pinned copy, loaded once (as in hf_causal_lm.py)
    _no_cache(model.config)
    vision_tower(model).requires_grad_(spec.train_vision_tower)
    if spec.init == "random":
        return model, RandomSource(model, seed, _initializer_range(config), device)
    load = lambda: build_image_text_model(spec, seed)  # noqa: E731
    return model, checkpoint_source(model, Path(spec.path), load, unmapped_loads_whole=True)


def _initializer_range(config: Any) -> float:
    text = getattr(config, "text_config", None)
    return float(getattr(config, "initializer_range", None) or getattr(text, "initializer_range", None) or 0.02)


def image_text_checkpoint_problems(spec: HFImageTextToTextSpec) -> list[tuple[str, str, str]]:
    """What keeps ``spec.path``'s safetensors from filling the model, from the files' headers alone: (tensor, file,
    what is wrong). Names the renamings do not place are not among them: such a checkpoint loads whole, as
    ``from_pretrained`` loads it. For ``init: random``, only that the config is an image-text model's."""
    if spec.init == "random":
        image_text_config(Path(spec.path))
        return []
    problems = checkpoint_problems(meta_image_text_model(spec), Path(spec.path), unmapped_loads_whole=True)
    return [(p.tensor, p.file, p.message) for p in problems]


def meta_image_text_model(spec: HFImageTextToTextSpec) -> nn.Module:
    """The model's shapes on the meta device, from ``config.json`` alone; what is frozen as the build freezes it."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(image_text_config(Path(spec.path)))
    model.tie_weights()
    vision_tower(model).requires_grad_(spec.train_vision_tower)
    return model


def _no_cache(config: Any) -> None:
    config.use_cache = False  # a KV cache is useless in training and costs memory
    text = getattr(config, "text_config", None)
    if text is not None:
        text.use_cache = False


def vision_tower_name(model: nn.Module) -> str:
    """The dotted name of the vision encoder (``model.visual``, ``model.vision_tower``, ``model.vision_model``).

    Raises:
        ValueError: the model has none of these (not a vision-language model Ferry knows the layout of).
    """
    for name, _ in model.named_modules():
        if name.split(".")[-1] in VISION_TOWERS:
            return name
    raise ValueError(f"{type(model).__name__} has no vision tower named {', '.join(VISION_TOWERS)}")


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision encoder module of ``model`` (see `vision_tower_name`)."""
    return model.get_submodule(vision_tower_name(model))


def language_lora_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """The full names of the modules ``targets`` match (peft's rule) outside the vision tower: Qwen2.5-VL's vision
    blocks have ``gate_proj``/``up_proj`` too, and LoRA there would train the tower the user asked to freeze."""
    tower = vision_tower_name(model) + "."
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not name.startswith(tower)
        and any(lora_target_matches(name, target) for target in targets)
    ]


def apply_image_text_lora(model: nn.Module, spec: LoraSpec, *, train_vision_tower: bool) -> nn.Module:
    """LoRA on the language model's ``spec.target_modules``; ``train_vision_tower``: the tower trains in full, saved
    with the adapter (peft's ``modules_to_save``)."""
    from jobs.models.lora import apply_lora

    names = language_lora_targets(model, list(spec.target_modules))
    if not names:
        raise ValueError(
            f"lora.target_modules {list(spec.target_modules)} match no Linear of the language model; name its "
            "projections, e.g. [q_proj, k_proj, v_proj, o_proj]"
        )
    saved = [*spec.modules_to_save, *([vision_tower_name(model)] if train_vision_tower else [])]
    adapted = spec.model_copy(update={"target_modules": names, "modules_to_save": saved})
    return apply_lora(model, adapted, task_type=None)


def image_text_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The next-token loss over the labels (-100 on prompts and images): transformers' own, or, where the float32
    logits of the batch would pass ``CHUNK_ABOVE_BYTES`` (8192 tokens of a 152064-token vocabulary: 5 GB), the
    decoder's hidden states through the head a chunk of positions at a time (jobs/recompute/chunked_loss.py)."""
    from jobs.recompute.chunked_loss import CHUNK_ABOVE_BYTES, chunked_nll

    base: Any = model.get_base_model() if is_peft_model(model) else model
    head = base.get_output_embeddings()
    decoder = getattr(base, "model", None)
    vocab = int(getattr(head, "out_features", 0))
    if not isinstance(decoder, nn.Module) or batch["labels"].numel() * vocab * 4 <= CHUNK_ABOVE_BYTES:
        return model(**batch).loss
    inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
    hidden = decoder(**inputs).last_hidden_state  # peft's adapters sit inside the modules: they run here too
    nll, counted = chunked_nll(head, hidden, batch["labels"])
    return nll.sum() / counted.sum().clamp(min=1)


def image_text_activation_bytes(spec: JobSpec, model: nn.Module) -> int:
    """The language decoder's, as for a Llama-style causal LM over ``data.seq_len`` tokens (image tokens are in
    it); the frozen tower's forward keeps nothing for backward."""
    config: Any = getattr(model.config, "text_config", model.config)
    dims = DecoderDims(
        config.hidden_size,
        int(getattr(config, "intermediate_size", None) or 4 * config.hidden_size),
        config.num_hidden_layers,
        config.vocab_size,
        (10, 4),
    )
    return decoder_activation_bytes(spec, dims)


def enable_image_text_checkpointing(model: nn.Module) -> None:
    """The decoder layers' reentrant checkpointing, as for causal LMs (jobs/models/hf_causal_lm.py)."""
    from jobs.models.hf_causal_lm import enable_hf_gradient_checkpointing

    enable_hf_gradient_checkpointing(model)


def save_image_text_checkpoint(model: nn.Module, directory: Path) -> None:
    """The adapter (with a trained tower) or the whole model as ``save_pretrained`` writes it, and the processor's
    files from the model's directory, so ``AutoProcessor`` and ``AutoModelForImageTextToText`` load the checkpoint."""
    save_hf_checkpoint(model, directory)
    base: Any = model.get_base_model() if is_peft_model(model) else model
    source = Path(str(getattr(base.config, "_name_or_path", "")))
    for name in PROCESSOR_FILES:
        if source.is_dir() and (source / name).is_file() and not (directory / name).exists():
            (directory / name).write_bytes((source / name).read_bytes())


def load_image_text_checkpoint(model: nn.Module, directory: Path) -> None:
    """Resume: the adapter, or the trainable tensors of a full checkpoint (the frozen tower comes from the base)."""
    from safetensors.torch import load_file

    if is_peft_model(model):
        from jobs.checkpoints.adapter import load_adapter

        load_adapter(model, directory)
        return
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = {k: v for f in files for k, v in load_file(str(directory / f)).items() if k in trainable}
    missing = sorted(trainable - set(state))
    if missing:
        raise ValueError(f"checkpoint {directory} lacks trainable tensors of the model: {missing[:5]}")
    model.load_state_dict(state, strict=False)


IMAGE_TEXT_WEIGHTS = WeightsFormat("hf_pretrained", save_image_text_checkpoint, load_image_text_checkpoint)
