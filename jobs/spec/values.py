"""Values a spec may not hold although pydantic's lax mode would take them, and words for readable errors.

Checked on the parsed YAML, next to pydantic (loading.py), so that each is reported with its path and line
together with every other problem:

- a lone surrogate or a control character in any key or string: neither belongs in a name, a path or a
  field name, and a lone surrogate cannot even be written out as UTF-8 (stored, it broke every answer
  that showed the job);
- ``true``/``false`` given for a number (lax mode reads ``steps: true`` as one step);
- an integer beyond int64, which the store (SQLite INTEGER) and torch cannot hold.

Infinite and NaN floats are refused by the sections themselves (``allow_inf_nan=False``).
"""

from __future__ import annotations

import types
import typing
import unicodedata
from typing import Any, Literal

from pydantic import BaseModel

INT64_MAX = 2**63 - 1
Path_ = tuple[str, ...]

# Words users write for a value the spec spells otherwise; difflib alone would offer `cpu` for `gpu`.
SYNONYMS = {
    "gpu": "cuda",
    "cuda:0": "cuda",
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "none": "no",
    # Hugging Face TrainingArguments' names (axolotl's too) for what Ferry spells shorter.
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "constant_with_warmup": "constant",
}
# Keys other fine-tuning tools (axolotl, Hugging Face TrainingArguments, peft, torchtune) use, and the Ferry
# path that holds the same setting: see `foreign_key_hint`.
FOREIGN_KEYS = {
    "base_model": "model.path",
    "model_name_or_path": "model.path",
    "lora_r": "lora.rank",
    "lora.r": "lora.rank",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules",
    "lr": "training.learning_rate",
    "learning_rate": "training.learning_rate",
    "micro_batch_size": "training.batch_size",
    "per_device_train_batch_size": "training.batch_size",
    "batch_size": "training.batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "num_epochs": "training.epochs",
    "num_train_epochs": "training.epochs",
    "epochs": "training.epochs",
    "max_steps": "training.steps",
    "steps": "training.steps",
    "warmup_steps": "training.scheduler.warmup_steps",
    "lr_scheduler": "training.scheduler.kind",
    "lr_scheduler_type": "training.scheduler.kind",
    "optimizer": "training.optimizer",
    "optim": "training.optimizer",
    "weight_decay": "training.weight_decay",
    "max_grad_norm": "training.max_grad_norm",
    "seed": "training.seed",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "torch_compile": "training.compile",
    "sequence_len": "data.seq_len",
    "max_seq_length": "data.seq_len",
    "max_seq_len": "data.seq_len",
    "chat_template": "data.chat_template",
    "train_on_inputs": "data.train_on_prompt",
    "sample_packing": "data.packing",
    "val_set_size": "eval.split",
    "eval_steps": "eval.every_steps",
    "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep_last",
}
# Patterns a reader should not have to decode.
PATTERN_RULES = {
    r"^[A-Za-z0-9][A-Za-z0-9._-]*$": "must start with a letter or digit and hold only letters, digits, '.', '_' and '-'"
}


def foreign_key_hint(path: list[str]) -> str | None:
    """The Ferry path for an unknown key another tool uses: its dotted path looked up first (peft's ``r``
    under ``lora:``), then the bare key, at the top level or inside the section its Ferry path lies in (so
    ``training.lr`` is hinted, while ``eval.steps`` is left to the closest key of ``eval``)."""
    if ".".join(path) in FOREIGN_KEYS:
        return FOREIGN_KEYS[".".join(path)]
    target = FOREIGN_KEYS.get(path[-1]) if path else None
    if target is not None and (len(path) == 1 or target.split(".")[0] == path[0]):
        return target
    return None


AXOLOTL_KEYS = ("base_model", "datasets", "pretraining_dataset", "micro_batch_size", "sequence_len")


def other_tools_config(data: dict[str, Any]) -> tuple[str, str] | None:
    """(key, problem) when ``data`` is another tool's whole config rather than a Ferry spec (axolotl's: a
    ``base_model`` and no ``model``), so it is refused once with the conversion instead of key by key."""
    if "model" in data or "base_model" not in data:
        return None
    found = ", ".join(key for key in AXOLOTL_KEYS if key in data)
    return "base_model", (
        f"this is an axolotl config ({found}), not a Ferry spec; convert it first: python -m jobs import-axolotl "
        "FILE prints the spec and what was not converted (the service converts it when posted with "
        "Content-Type: application/x-axolotl+yaml)"
    )


def bad_strings(value: Any, path: Path_ = ()) -> list[tuple[Path_, str]]:
    """(path, problem) for every key or string holding a lone surrogate or a control character."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            key_path = (*path, _printable(key))
            found += [(key_path, f"key {problem}") for problem in _string_problems(key)]
            found += bad_strings(item, key_path)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += bad_strings(item, (*path, str(index)))
    else:
        found += [(path, problem) for problem in _string_problems(value)]
    return found


def bad_numbers(data: Any, model: type[BaseModel], path: Path_ = ()) -> list[tuple[Path_, str]]:
    """(path, problem) for each boolean given for a number and each integer beyond int64, walking ``data``
    along ``model``'s fields (a discriminated section is picked by its ``kind``)."""
    if not isinstance(data, dict):
        return []
    found = []
    for name, value in data.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            continue
        where = (*path, name)
        if isinstance(value, bool):
            if not _takes_bool(field.annotation):
                found.append((where, f"must be a number, not {str(value).lower()}"))
        elif isinstance(value, int) and abs(value) > INT64_MAX:
            found.append(
                (where, f"must be within ±(2**63 - 1), what the store holds; got a {value.bit_length()}-bit number")
            )
        elif isinstance(value, dict):
            section = _section_for(field.annotation, value)
            if section is not None:
                found += bad_numbers(value, section, where)
        elif isinstance(value, list):  # a list of sections (data.mix): each item along its section's fields
            items = list_items(field.annotation)
            for index, item in enumerate(value):
                section = _section_for(items, item) if isinstance(item, dict) and items is not None else None
                if section is not None:
                    found += bad_numbers(item, section, (*where, str(index)))
    return found


def list_items(annotation: Any) -> Any:
    """The item type of the list a field's annotation admits (``list[DataSourceSpec] | None``), else None."""
    lists = [t for t in flatten_annotation(annotation) if typing.get_origin(t) is list]
    return typing.get_args(lists[0])[0] if lists and typing.get_args(lists[0]) else None


def _section_for(annotation: Any, value: dict) -> type[BaseModel] | None:
    """The section type a mapping is validated as: the only one, or the one whose ``kind`` it names."""
    models = [t for t in flatten_annotation(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    if len(models) == 1:
        return models[0]
    for candidate in models:
        kind = candidate.model_fields.get("kind")
        if kind is not None and value.get("kind") in typing.get_args(kind.annotation):
            return candidate
    return None


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type admits ``True``/``False`` (``bool``, ``bool | None``, ``Literal[True, ...]``)."""
    return any(
        t is bool
        or t is Any
        or (typing.get_origin(t) is Literal and any(isinstance(a, bool) for a in typing.get_args(t)))
        for t in flatten_annotation(annotation)
    )


def flatten_annotation(annotation: Any) -> list[Any]:
    """The types a field's annotation admits: ``Annotated`` unwrapped, unions (nested ones too) spread out."""
    if typing.get_origin(annotation) is typing.Annotated:
        return flatten_annotation(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in flatten_annotation(arg)]
    return [annotation]


def _string_problems(value: Any) -> list[str]:
    if not isinstance(value, str):
        return []
    for index, char in enumerate(value):
        if "\ud800" <= char <= "\udfff":
            return [f"holds a lone surrogate ({ascii(char)[1:-1]}) at character {index + 1}; send valid Unicode text"]
        if unicodedata.category(char) == "Cc" and char not in "\t\n\r":
            return [f"holds the control character {ascii(char)[1:-1]} at character {index + 1}; remove it"]
    return []


def _printable(key: Any) -> str:
    """A key as a path part; one with a surrogate or control character is shown escaped."""
    text = str(key)
    return ascii(text)[1:-1] if _string_problems(text) else text
