"""``model.kind: hf_image_text_to_text``: vision-language models trained on ``data.kind: image_chat``.

The registry entry; the pieces live beside it: spec.py (sections), model.py (build, vision tower, LoRA, loss,
checkpoints), processor.py, records.py and images.py (rows), batches.py (tokens, labels and image tensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import nn

from jobs.errors import Problem
from jobs.models.family import ModelFamily
from jobs.models.hf_names import lora_can_wrap
from jobs.models.vlm.model import (
    IMAGE_TEXT_WEIGHTS,
    apply_image_text_lora,
    build_image_text_model,
    build_image_text_model_on_meta,
    enable_image_text_checkpointing,
    image_text_activation_bytes,
    image_text_checkpoint_problems,
    image_text_loss,
    meta_image_text_model,
    vision_tower_name,
)
from jobs.models.vlm.spec import HFImageTextToTextSpec, ImageChatDataSpec, ImageSamplesSpec

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec

SUBMIT_ROWS = 2000  # rows of each file checked at submit, images opened: seconds, not the whole data set


def build_image_chat(spec: JobSpec, device: torch.device, model: nn.Module) -> Any:
    """The job's batches: rows read and tokenized with the model's processor."""
    from jobs.models.vlm.batches import build_image_chat_data
    from jobs.models.vlm.processor import ProcessorText, load_processor

    text = ProcessorText(load_processor(Path(spec.model.path)))
    return build_image_chat_data(spec.data, spec.training.batch_size, spec.training.seed, text, spec.eval)


def module_names(spec: HFImageTextToTextSpec) -> dict[str, bool]:
    """Every module name of the model (from config.json), with whether LoRA can wrap it."""
    return {name: lora_can_wrap(module) for name, module in meta_image_text_model(spec).named_modules() if name}


def _check_sections(spec: JobSpec) -> list[Problem]:
    problems: list[Problem] = []
    if spec.training.objective != "sft":
        problems.append(("training.objective", f"hf_image_text_to_text trains sft; got {spec.training.objective}"))
    return problems


def _check_data(spec: JobSpec) -> list[Problem]:
    """At submit: the processor loads and the first rows read (images opened), a problem naming its row; the job
    reads every row again when it starts, refusing a bad one the same way."""
    if spec.data.kind != "image_chat":
        return []
    from jobs.models.vlm.batches import read_rows
    from jobs.models.vlm.processor import ProcessorText, load_processor

    try:
        text = ProcessorText(load_processor(Path(spec.model.path)))
        read_rows(spec.data, text, limit=SUBMIT_ROWS)
    except ValueError as error:
        return [("data.path", str(error))]
    problems: list[Problem] = []
    if spec.eval is not None and spec.eval.path is not None:
        try:
            read_rows(spec.data.model_copy(update={"path": spec.eval.path}), text, limit=SUBMIT_ROWS)
        except ValueError as error:
            problems.append(("eval.path", str(error)))
    if spec.text_samples is not None:
        from jobs.data.formats.examples import RecordError
        from jobs.models.vlm.samples import make_text_samples

        try:
            make_text_samples(spec, torch.device("cpu")).close()  # each prompt's images opened, as the job will
        except RecordError as error:
            problems.append(("text_samples.prompts", f"{error} (images are read beside data.path)"))
    return problems


def make_sampler(spec: JobSpec, device: torch.device) -> Any:
    from jobs.models.vlm.samples import make_image_sampler

    return make_image_sampler(spec, device)


def make_text_samples(spec: JobSpec, device: torch.device) -> Any:
    from jobs.models.vlm.samples import make_text_samples

    return make_text_samples(spec, device)


def _check_image_samples_section(spec: JobSpec, family: ModelFamily[Any]) -> list[Problem]:
    # Runs for every job (section_rules): only this family writes image samples or reads content parts.
    if family.kind == "hf_image_text_to_text":
        return []
    problems: list[Problem] = []
    if getattr(spec, "image_samples", None) is not None:
        problems.append(("image_samples", f"model.kind={spec.model.kind} does not answer images; remove the section"))
    for index, prompt in enumerate(spec.text_samples.prompts if spec.text_samples is not None else []):
        for number, message in enumerate(prompt if isinstance(prompt, list) else []):
            if message.has_parts():
                problems.append(
                    (
                        f"text_samples.prompts.{index}.{number}.content",
                        f"content parts (images) are for model.kind=hf_image_text_to_text; {spec.model.kind} reads "
                        "text: write the content as a string",
                    )
                )
    return problems


def _adapters_only(spec: JobSpec) -> bool:
    """LoRA adds adapters and nothing else: the tower is not copied to train in full (``train_vision_tower``, peft's
    ``modules_to_save``), which would copy a meta model's absent values."""
    return spec.lora is None or not spec.model.train_vision_tower


FAMILY = ModelFamily(
    kind="hf_image_text_to_text",
    spec=HFImageTextToTextSpec,
    build=build_image_text_model,
    loss=image_text_loss,
    data_kinds=("image_chat",),
    meta_model=meta_image_text_model,
    activation_bytes=image_text_activation_bytes,
    lora_target_names=lambda spec: None,  # read from config.json at submit (module_names_from_files)
    module_names_from_files=module_names,
    enable_gradient_checkpointing=enable_image_text_checkpointing,
    weights_format=IMAGE_TEXT_WEIGHTS,
    rules=(_check_sections, _check_data),
    apply_lora=lambda model, lora: apply_image_text_lora(model, lora, train_vision_tower=_trains_tower(model)),
    build_data=build_image_chat,
    build_on_meta=build_image_text_model_on_meta,
    adapts_on_meta=_adapters_only,
    checkpoint_problems=image_text_checkpoint_problems,
    whole_units=lambda model: () if _trains_tower(model) else (vision_tower_name(model),),
    data_specs=(ImageChatDataSpec,),
    make_sampler=make_sampler,
    make_text_samples=make_text_samples,
    holds_out_eval=True,
    job_sections={
        "image_samples": (
            ImageSamplesSpec | None,
            Field(None, description="image-text models: rows of the data answered with each checkpoint"),
        )
    },
    section_rules=(_check_image_samples_section,),
)


def _trains_tower(model: nn.Module) -> bool:
    """Whether the build left the tower trainable (``model.train_vision_tower``): what LoRA then keeps training."""
    from jobs.models.vlm.model import vision_tower

    return any(p.requires_grad for p in vision_tower(model).parameters())
