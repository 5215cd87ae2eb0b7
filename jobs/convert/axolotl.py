"""An axolotl config as a Ferry job spec, with every key that cannot be honoured listed and why.

Torch-free (YAML and dictionaries only), so the API process converts at submit and ``python -m jobs
import-axolotl FILE`` prints the result. The spec it builds is checked like any other when it is loaded.

What maps: ``base_model`` (and ``tokenizer_config``), ``datasets`` (``chat_template``, ``sharegpt``, ``alpaca``,
``completion``; several of one type become ``data.mix``), ``chat_template`` (``chatml`` or ``jinja``),
``adapter: lora | qlora`` with ``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``,
``lora_target_linear``, ``lora_modules_to_save``, ``load_in_4bit`` / ``load_in_8bit``, ``micro_batch_size``,
``gradient_accumulation_steps``, ``num_epochs`` / ``max_steps``, ``learning_rate``, ``lr_scheduler``,
``warmup_steps`` (``warmup_ratio`` with ``max_steps``), ``optimizer``, ``weight_decay``, ``max_grad_norm``,
``gradient_checkpointing``, ``bf16`` / ``fp16``, ``val_set_size``, ``eval_steps``, ``early_stopping_patience``,
``save_steps``, ``save_total_limit``, ``sequence_len``, ``sample_packing``, ``train_on_inputs``, ``seed``,
``wandb_project``.

Example:
    >>> converted = convert_axolotl(open("examples/llama-3/lora-1b.yml").read())
    >>> print(converted.to_yaml())   # the Ferry spec, the warnings as comments at its top
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

# What lora_target_linear expands to: every linear layer of a Llama-style decoder (Ferry names modules).
LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_TARGETS = ["q_proj", "v_proj"]  # peft's default for Llama-style models
_OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "adamw": "adamw",
    "adam": "adam",
    "sgd": "sgd",
}
_APPROXIMATE_OPTIMIZERS = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_apex_fused")
_SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}
# Keys that change nothing Ferry does, with why; listed as warnings when they are set.
_IGNORED = {
    "model_type": "Ferry reads the architecture from the model's config.json",
    "tokenizer_type": "Ferry loads the tokenizer with AutoTokenizer",
    "output_dir": "Ferry keeps a job's outputs in its own directory (jobs/<id>/output, or --output)",
    "dataset_prepared_path": "Ferry tokenizes as it reads and keeps no prepared copy",
    "flash_attention": "Ferry uses transformers' default attention implementation",
    "sdp_attention": "Ferry uses transformers' default attention implementation",
    "xformers_attention": "Ferry uses transformers' default attention implementation",
    "tf32": "TF32 matmuls are PyTorch's default choice on the GPU, not a spec setting",
    "logging_steps": "every step is an event (GET /v1/jobs/<id>/events)",
    "eval_sample_packing": "evaluation batches as training does",
    "special_tokens": "Ferry uses the tokenizer as saved; add tokens to it before training",
    "tokens": "Ferry uses the tokenizer as saved; add tokens to it before training",
    "resume_from_checkpoint": "Ferry resumes a job from its own last checkpoint (POST /v1/jobs/<id>/resume)",
    "auto_resume_from_checkpoints": "Ferry resumes a job from its own last checkpoint",
    "deepspeed": "Ferry trains one job per GPU; it streams weights from CPU memory instead (offload)",
    "fsdp": "Ferry trains one job per GPU; it streams weights from CPU memory instead (offload)",
    "fsdp_config": "Ferry trains one job per GPU; it streams weights from CPU memory instead (offload)",
    "evals_per_epoch": "Ferry evaluates every eval.every_steps steps; an epoch's steps depend on the data",
    "saves_per_epoch": "Ferry checkpoints every checkpoint.every_steps steps and at the end; an epoch's steps "
    "depend on the data, so only the final checkpoint is kept unless save_steps is set",
    "strict": "Ferry always refuses unknown keys",
    "lora_model_dir": "Ferry starts a LoRA from fresh adapters; resume a Ferry job instead",
    "wandb_entity": "tracking.wandb takes a project and a mode only",
    "wandb_watch": "tracking.wandb takes a project and a mode only",
    "wandb_name": "tracking.wandb takes a project and a mode only",
    "wandb_log_model": "tracking.wandb takes a project and a mode only",
    "group_by_length": "padded batches are grouped by length already (data.packing: padded)",
    "pad_to_sequence_len": "Ferry pads a batch to its longest row",
    "debug": "not a training setting",
    "local_rank": "not a training setting",
}
_SET_ELSEWHERE = {  # read while building a section, not on their own
    "base_model",
    "base_model_config",
    "tokenizer_config",
    "datasets",
    "chat_template",
    "chat_template_jinja",
    "adapter",
    "load_in_4bit",
    "load_in_8bit",
    "train_on_inputs",
    "sample_packing",
    "sequence_len",
}


@dataclass
class AxolotlConversion:
    """The Ferry spec built from an axolotl config, and one line per key it could not honour (``key: why``)."""

    spec: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    def to_yaml(self) -> str:
        """The spec as YAML, the warnings as comments above it (they stay with the spec when it is stored)."""
        header = "# Converted from an axolotl config.\n"
        if self.warnings:
            header += "# Not honoured:\n" + "".join(f"#   {w}\n" for w in self.warnings)
        return header + yaml.safe_dump(self.spec, sort_keys=False)


def convert_axolotl(text: str) -> AxolotlConversion:
    """Convert an axolotl YAML config to a Ferry spec (see the module docstring for what maps).

    Raises:
        ValueError: the text is not a YAML mapping, or names no ``base_model`` or no ``datasets``.
    """
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"the axolotl config is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise ValueError("an axolotl config is a YAML mapping")
    config = {str(k): v for k, v in config.items() if v is not None and v != ""}  # unset, as axolotl reads it
    missing = [key for key in ("base_model", "datasets") if not config.get(key)]
    if missing:
        raise ValueError(f"the axolotl config has no {' and no '.join(missing)}; Ferry needs both")
    converted = AxolotlConversion(spec={})
    spec = converted.spec
    spec["name"] = _name(config)
    spec["model"] = _model(config, converted.warnings)
    spec["data"] = _data(config, converted.warnings)
    lora = _lora(config, converted.warnings)
    if lora:
        spec["lora"] = lora
    spec["training"] = _training(config, converted.warnings)
    for section, build in (("eval", _eval), ("checkpoint", _checkpoint), ("tracking", _tracking)):
        value = build(config)
        if value:
            spec[section] = value
    handled = _SET_ELSEWHERE | _HANDLED
    for key in config:
        if key in _IGNORED:
            if config[key] not in (False, 0, [], {}):
                converted.warnings.append(f"{key}: {_IGNORED[key]}")
        elif key not in handled:
            converted.warnings.append(f"{key}: not a setting Ferry maps; see the spec reference in the README")
    return converted


def _name(config: dict[str, Any]) -> str:
    stem = str(config["base_model"]).rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{stem}-axolotl").strip("-._")[:128] or "axolotl"


def _model(config: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    model: dict[str, Any] = {"kind": "hf_causal_lm", "path": str(config["base_model"])}
    if config.get("load_in_4bit") or config.get("adapter") == "qlora":
        model["quantize"] = "nf4"
    elif config.get("load_in_8bit"):
        model["quantize"] = "int8"
    if config.get("base_model_config") and config["base_model_config"] != config["base_model"]:
        warnings.append("base_model_config: Ferry reads config.json from base_model's directory")
    return model


def _data(config: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    datasets = config["datasets"] if isinstance(config["datasets"], list) else [config["datasets"]]
    datasets = [d if isinstance(d, dict) else {"path": d} for d in datasets]
    first = datasets[0]
    data: dict[str, Any] = {"kind": "text", **_format(first, config, warnings)}
    paths = [str(d.get("data_files") or d.get("path")) for d in datasets]
    kept = [p for d, p in zip(datasets, paths, strict=True) if d.get("type", first.get("type")) == first.get("type")]
    for d in datasets[1:]:
        if d.get("type", first.get("type")) != first.get("type"):
            warnings.append(f"datasets: {d.get('path')} has type {d.get('type')!r}; one job reads one format, left out")
    if len(kept) > 1:
        data["mix"] = [{"path": p} for p in kept]
    else:
        data["path"] = kept[0]
    if first.get("ds_type") in ("json", "csv", "parquet"):
        data["file_type"] = {"json": "jsonl"}.get(first["ds_type"], first["ds_type"])
    for key in ("split", "name", "revision"):
        if first.get(key) not in (None, "train"):
            warnings.append(f"datasets[0].{key}: Ferry reads local files whole; point path at the split's file")
    if "sequence_len" in config:
        data["seq_len"] = int(config["sequence_len"])
    if "sample_packing" in config:
        data["packing"] = "packed" if config["sample_packing"] else "padded"
    if config.get("train_on_inputs"):
        data["train_on_prompt"] = True
    tokenizer = config.get("tokenizer_config") or config["base_model"]
    data["tokenizer"] = {"kind": "hf", "path": str(tokenizer)}
    return data


def _format(dataset: dict[str, Any], config: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    kind = str(dataset.get("type", "alpaca"))
    if kind == "alpaca":
        return {"format": "instruction"}
    if kind == "completion":
        return {"format": "text", "text_field": str(dataset.get("field", "text"))}
    if kind in ("chat_template", "sharegpt"):
        chat: dict[str, Any] = {"format": "chat"}
        default = "messages" if kind == "chat_template" else "conversations"
        field_name = str(dataset.get("field_messages", default))
        if field_name != "messages":
            chat["messages_field"] = field_name
        template = _chat_template(config, warnings)
        if template:
            chat["chat_template"] = template
        mappings = dataset.get("message_property_mappings") or {}
        if any(mappings.get(k, k) != k for k in ("role", "content")):
            warnings.append("datasets[0].message_property_mappings: Ferry reads role and content as named")
        roles = dataset.get("roles_to_train")
        if roles not in (None, ["assistant"], ["gpt"]):
            warnings.append("datasets[0].roles_to_train: Ferry trains on assistant turns (train_on_inputs: everything)")
        return chat
    warnings.append(
        f"datasets[0].type: {kind!r} is not a format Ferry reads (chat_template, sharegpt, alpaca, completion)"
    )
    return {"format": "text"}


def _chat_template(config: dict[str, Any], warnings: list[str]) -> str | None:
    name = config.get("chat_template")
    if name in (None, "tokenizer_default"):
        return None
    if name == "chatml":
        return "chatml"
    if name == "jinja" and config.get("chat_template_jinja"):
        return str(config["chat_template_jinja"])
    warnings.append(
        f"chat_template: {name!r} is not built into Ferry (chatml is); the tokenizer's own template is used "
        "(or give chat_template: jinja with chat_template_jinja)"
    )
    return None


def _lora(config: dict[str, Any], warnings: list[str]) -> dict[str, Any] | None:
    adapter = config.get("adapter")
    if adapter not in ("lora", "qlora"):
        if adapter is not None:
            warnings.append(f"adapter: {adapter!r} is not supported (lora, qlora); the whole model trains")
        return None
    lora: dict[str, Any] = {}
    if config.get("lora_target_modules"):
        lora["target_modules"] = [str(m) for m in config["lora_target_modules"]]
    elif config.get("lora_target_linear"):
        lora["target_modules"] = list(LINEAR_MODULES)
        warnings.append(
            "lora_target_linear: expanded to the Llama-style linear layers "
            f"({', '.join(LINEAR_MODULES)}); set lora.target_modules for other architectures"
        )
    else:
        lora["target_modules"] = list(DEFAULT_TARGETS)
    if config.get("lora_target_modules") and config.get("lora_target_linear"):
        lora["target_modules"] = sorted(set(lora["target_modules"]) | set(LINEAR_MODULES))
    for key, name in (("lora_r", "rank"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout")):
        if key in config:
            lora[name] = config[key]
    if config.get("lora_modules_to_save"):
        lora["modules_to_save"] = [str(m) for m in config["lora_modules_to_save"]]
    if config.get("peft_use_dora"):
        lora["use_dora"] = True
    if config.get("peft_use_rslora"):
        lora["use_rslora"] = True
    return lora


def _training(config: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    training: dict[str, Any] = {}
    if config.get("max_steps"):
        training["steps"] = int(config["max_steps"])
        if config.get("num_epochs"):
            warnings.append("num_epochs: max_steps is set and wins, as in transformers' Trainer")
    else:
        training["epochs"] = int(config.get("num_epochs", 1))
    for key, name in (
        ("micro_batch_size", "batch_size"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
        ("weight_decay", "weight_decay"),
        ("max_grad_norm", "max_grad_norm"),
        ("seed", "seed"),
    ):
        if key in config:
            training[name] = config[key]
    if "learning_rate" in config:
        training["learning_rate"] = float(config["learning_rate"])  # YAML reads 2e-4 as a string
    optimizer = config.get("optimizer")
    if optimizer is not None:
        training["optimizer"] = _OPTIMIZERS.get(str(optimizer), "adamw")
        if optimizer in _APPROXIMATE_OPTIMIZERS:
            warnings.append(f"optimizer: {optimizer} (8-bit, paged or apex state) is trained as plain adamw")
        elif optimizer not in _OPTIMIZERS:
            warnings.append(f"optimizer: {optimizer!r} is not supported (adamw, adam, sgd); adamw is used")
    scheduler = _scheduler(config, warnings)
    if scheduler:
        training["scheduler"] = scheduler
    if config.get("gradient_checkpointing"):
        training["gradient_checkpointing"] = True
    if config.get("bf16") in (True, "auto", "true"):
        training["mixed_precision"] = "bf16"
    elif config.get("fp16") in (True, "auto", "true"):
        training["mixed_precision"] = "fp16"
    return training


def _scheduler(config: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    scheduler: dict[str, Any] = {}
    name = config.get("lr_scheduler")
    if name is not None:
        scheduler["kind"] = _SCHEDULERS.get(str(name), "constant")
        if name not in _SCHEDULERS:
            warnings.append(f"lr_scheduler: {name!r} is not supported (cosine, linear, constant); constant is used")
    if "warmup_steps" in config:
        scheduler["warmup_steps"] = int(config["warmup_steps"])
    elif config.get("warmup_ratio"):
        if config.get("max_steps"):
            scheduler["warmup_steps"] = round(float(config["warmup_ratio"]) * int(config["max_steps"]))
        else:
            warnings.append(
                "warmup_ratio: Ferry warms up for a number of steps; set warmup_steps (no max_steps to scale)"
            )
    return scheduler


def _eval(config: dict[str, Any]) -> dict[str, Any] | None:
    size = config.get("val_set_size")
    if not size:
        return None
    evaluation: dict[str, Any] = {"split": float(size)}
    if config.get("eval_steps") and float(config["eval_steps"]) >= 1:
        evaluation["every_steps"] = int(config["eval_steps"])
    if config.get("early_stopping_patience"):
        evaluation["early_stopping"] = {"patience": int(config["early_stopping_patience"])}
    return evaluation


def _checkpoint(config: dict[str, Any]) -> dict[str, Any] | None:
    checkpoint: dict[str, Any] = {}
    if config.get("save_steps") and float(config["save_steps"]) >= 1:
        checkpoint["every_steps"] = int(config["save_steps"])
    if config.get("save_total_limit"):
        checkpoint["keep_last"] = int(config["save_total_limit"])
    return checkpoint or None


def _tracking(config: dict[str, Any]) -> dict[str, Any] | None:
    if not config.get("wandb_project"):
        return None
    mode = "online" if config.get("wandb_mode") == "online" else "offline"
    return {"wandb": {"project": str(config["wandb_project"]), "mode": mode}}


_HANDLED = {
    "max_steps",
    "num_epochs",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "weight_decay",
    "max_grad_norm",
    "seed",
    "learning_rate",
    "optimizer",
    "lr_scheduler",
    "warmup_steps",
    "warmup_ratio",
    "gradient_checkpointing",
    "bf16",
    "fp16",
    "val_set_size",
    "eval_steps",
    "early_stopping_patience",
    "save_steps",
    "save_total_limit",
    "wandb_project",
    "wandb_mode",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_linear",
    "lora_modules_to_save",
    "peft_use_dora",
    "peft_use_rslora",
}
