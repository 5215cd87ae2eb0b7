"""An axolotl config as a Ferry job spec: every key mapped, or listed as not converted and why.

Torch-free (YAML and dictionaries only), so the API process converts at submit and ``python -m jobs
import-axolotl FILE`` prints the result. The spec it builds is checked like any other when it is loaded.

What maps: ``base_model`` (and ``tokenizer_config``); ``datasets`` or ``pretraining_dataset`` (data.py: chat,
ShareGPT, alpaca, completion and pretraining text, preference pairs under ``rl``; ``data_files``; several entries of
equal settings become ``data.mix``); ``rl: dpo | ipo | orpo`` (``rl_beta``, ``orpo_alpha``); ``chat_template``;
``adapter: lora | qlora`` and its keys (lora.py, a regex ``lora_target_modules`` included); ``load_in_4bit`` /
``load_in_8bit``; the optimizer, schedule, precision, eval, checkpoint and wandb keys below.

Example:
    >>> converted = convert_axolotl(open("examples/llama-3/lora-1b.yml").read())
    >>> print(converted.to_yaml())   # the Ferry spec, then what was not converted, as comments
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from jobs.convert.axolotl.conversion import AxolotlConversion
from jobs.convert.axolotl.data import data_section, looks_local
from jobs.convert.axolotl.keys import UNKNOWN, asks_for_nothing, reason_for
from jobs.convert.axolotl.lora import lora_section
from jobs.convert.axolotl.reader import AxolotlConfig, shown
from jobs.spec.text import parse_spec_text
from jobs.spec.yaml_guard import MAX_DEPTH, MAX_NODES, ShapeGuard, YamlShapeError, shape_error

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
_OBJECTIVES = {"dpo": "dpo", "ipo": "dpo", "orpo": "orpo"}
_ON = (True, "auto", "true", "True")


def convert_axolotl(text: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> AxolotlConversion:
    """Convert an axolotl YAML config to a Ferry spec (see the module docstring for what maps).

    The text is read under the YAML shape guard (``max_depth``, ``max_nodes``: an alias bomb stops before it
    expands), and the result is serialized and read back before it is returned.

    Raises:
        ValueError: the text is not a YAML mapping, is too deep or too large, names no ``base_model`` or no
            data, holds a value of the wrong type, or asks for what Ferry does not train; each names the key.
    """
    config = AxolotlConfig(_parse(text, max_depth=max_depth, max_nodes=max_nodes))
    missing = [
        k
        for k in ("base_model", "datasets")
        if k not in config and not (k == "datasets" and "pretraining_dataset" in config)
    ]
    if missing:
        raise ValueError(f"the axolotl config has no {' and no '.join(missing)}; Ferry needs both")
    conversion = AxolotlConversion(spec={})
    spec = conversion.spec
    objective = _objective(config)
    spec["name"] = _name(config)
    spec["model"] = _model(config, conversion)
    spec["data"] = data_section(config, conversion, preference=objective is not None)
    _data_extras(config, spec["data"], conversion, preference=objective is not None)
    lora = lora_section(config, conversion.notes)
    if lora:
        spec["lora"] = _lora_for_objective(lora, objective, conversion)
    spec["training"] = _training(config, conversion, objective)
    for section, value in (
        ("eval", _eval(config, conversion)),
        ("checkpoint", _checkpoint(config, conversion)),
        ("tracking", _tracking(config)),
    ):
        if value:
            spec[section] = value
    _list_the_rest(config, conversion)
    conversion.to_yaml()  # serialized and read back once here, so a conversion that returns is one that prints
    return conversion


def _parse(text: str, *, max_depth: int, max_nodes: int) -> dict[str, Any]:
    try:
        data = parse_spec_text(text, on_event=ShapeGuard(max_depth=max_depth, max_nodes=max_nodes).see).data
    except YamlShapeError as error:
        raise ValueError(error.message.replace("the spec", "the axolotl config", 1)) from None
    except yaml.YAMLError as error:
        raise ValueError(shape_error(error).message.replace("the spec", "the axolotl config", 1)) from None
    except RecursionError:
        raise ValueError("the axolotl config nests too deep to read; flatten it") from None
    if not isinstance(data, dict):
        raise ValueError("an axolotl config is a YAML mapping (base_model: ..., datasets: ...)")
    return data


def _objective(config: AxolotlConfig) -> str | None:
    """``training.objective`` for ``rl``; refuses what Ferry does not train rather than train something else."""
    for key in ("reward_model", "process_reward_model"):
        if config.flag(key):
            raise ValueError(f"{key}: Ferry trains causal LMs (sft, dpo, orpo), not reward models; remove it")
    rl = config.text("rl", example="dpo")
    if rl is None or rl in ("false", "False"):
        return None
    if rl not in _OBJECTIVES:
        raise ValueError(f"rl: {shown(rl)} is not an objective Ferry trains (dpo, ipo, orpo); remove rl for SFT")
    return rl


def _name(config: AxolotlConfig) -> str:
    stem = str(config.text("base_model")).rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{stem}-axolotl").strip("-._")[:128] or "axolotl"


def _model(config: AxolotlConfig, conversion: AxolotlConversion) -> dict[str, Any]:
    path = config.text("base_model", example="Llama-3.2-1B")
    assert path is not None  # checked in convert_axolotl
    model: dict[str, Any] = {"kind": "hf_causal_lm", "path": path}
    conversion.notes += _hub_note("base_model", path)
    if config.flag("load_in_4bit") or config.raw("adapter") == "qlora":
        model["quantize"] = "nf4"
    elif config.flag("load_in_8bit"):
        model["quantize"] = "int8"
    base_config = config.text("base_model_config")
    if base_config and base_config != path:
        conversion.not_converted.append(("base_model_config", "Ferry reads config.json from base_model's directory"))
    return model


def _hub_note(key: str, path: str) -> list[str]:
    if looks_local(path):
        return []
    repo = shown(path)[1:-1]
    return [
        f"{key}: {shown(path)} looks like a Hugging Face Hub id; Ferry reads local paths only, so it must be a "
        f"directory under a model root. Fetch it first: huggingface-cli download {repo} --local-dir <model root>/{repo}"
    ]


def _lora_for_objective(lora: dict[str, Any], objective: str | None, conversion: AxolotlConversion) -> dict[str, Any]:
    """DPO's reference is the base with the adapters off: a fully trained module or DoRA has no such reference."""
    if objective not in ("dpo", "ipo"):
        return lora
    for key, name in (("lora_modules_to_save", "modules_to_save"), ("peft_use_dora", "use_dora")):
        if lora.pop(name, None):
            conversion.not_converted.append(
                (key, "dpo takes the reference from the base with plain LoRA adapters off, so it trains plain LoRA")
            )
    return lora


def _data_extras(
    config: AxolotlConfig, data: dict[str, Any], conversion: AxolotlConversion, *, preference: bool
) -> None:
    """The top-level keys that shape the data: length, packing, prompt loss, tokenizer."""
    seq_len = config.integer("sequence_len", example=2048)
    if seq_len is not None:
        data["seq_len"] = seq_len
    if "sample_packing" in config:
        packed = config.flag("sample_packing")
        if preference and packed:
            conversion.not_converted.append(("sample_packing", "preference pairs are batched as padded pairs"))
        else:
            data["packing"] = "packed" if packed else "padded"
    if config.flag("train_on_inputs") and not preference:
        data["train_on_prompt"] = True
    tokenizer = config.text("tokenizer_config") or config.text("base_model")
    data["tokenizer"] = {"kind": "hf", "path": str(tokenizer)}
    if tokenizer != config.text("base_model"):
        conversion.notes += _hub_note("tokenizer_config", str(tokenizer))


def _training(config: AxolotlConfig, conversion: AxolotlConversion, rl: str | None) -> dict[str, Any]:
    training: dict[str, Any] = {}
    steps, epochs = config.integer("max_steps", example=1000), config.number("num_epochs", example="1")
    if steps:
        training["steps"] = steps
        if epochs:
            conversion.not_converted.append(("num_epochs", "max_steps is set and wins, as in transformers' Trainer"))
    else:
        training["epochs"] = max(1, math.ceil(epochs or 1))
        if epochs and not float(epochs).is_integer():
            conversion.not_converted.append(
                ("num_epochs", f"Ferry trains whole epochs ({training['epochs']}); set training.steps for less")
            )
    micro, accumulation = (
        config.integer("micro_batch_size", example=2),
        config.integer("gradient_accumulation_steps", example=4),
    )
    total = config.integer("batch_size", example=8)
    if micro is not None:
        training["batch_size"] = micro
    if accumulation is None and total and micro:
        accumulation = max(1, total // micro)  # axolotl's batch_size is micro_batch_size x accumulation
    if accumulation is not None:
        training["gradient_accumulation_steps"] = accumulation
    for key, name in (
        ("weight_decay", "weight_decay"),
        ("max_grad_norm", "max_grad_norm"),
        ("learning_rate", "learning_rate"),
    ):
        value = config.number(key)
        if value is not None:
            training[name] = value
    seed = config.integer("seed", example=42)
    if seed is not None:
        training["seed"] = seed
    _optimizer(config, training, conversion)
    scheduler = _scheduler(config, conversion)
    if scheduler:
        training["scheduler"] = scheduler
    checkpointing = config.raw("gradient_checkpointing")
    if checkpointing in _ON or checkpointing in ("unsloth", "offload"):
        training["gradient_checkpointing"] = True
    bf16, fp16 = config.raw("bf16"), config.raw("fp16")
    if bf16 in _ON:
        training["mixed_precision"] = "bf16"
    elif fp16 in _ON:
        training["mixed_precision"] = "fp16"
    if rl is not None:
        _preference_objective(config, training, rl)
    return training


def _optimizer(config: AxolotlConfig, training: dict[str, Any], conversion: AxolotlConversion) -> None:
    optimizer = config.text("optimizer", example="adamw_torch")
    if optimizer is None:
        return
    training["optimizer"] = _OPTIMIZERS.get(optimizer, "adamw")
    if optimizer in _APPROXIMATE_OPTIMIZERS:
        conversion.notes.append(f"optimizer: {optimizer} (8-bit, paged or apex state) is trained as plain adamw")
    elif optimizer not in _OPTIMIZERS:
        conversion.not_converted.append(
            ("optimizer", f"{shown(optimizer)} is not an optimizer Ferry has (adamw, adam, sgd); adamw is used")
        )


def _preference_objective(config: AxolotlConfig, training: dict[str, Any], rl: str) -> None:
    objective = _OBJECTIVES[rl]
    training["objective"] = objective
    if objective == "dpo":
        dpo: dict[str, Any] = {"loss_type": "ipo"} if rl == "ipo" else {}
        beta = config.number("rl_beta", example="0.1")
        if beta is not None:
            dpo["beta"] = beta
        if dpo:
            training["dpo"] = dpo
    else:
        beta = config.number("orpo_alpha", example="0.1")  # axolotl's name for the ORPO paper's lambda
        if beta is not None:
            training["orpo"] = {"beta": beta}


def _scheduler(config: AxolotlConfig, conversion: AxolotlConversion) -> dict[str, Any]:
    scheduler: dict[str, Any] = {}
    name = config.text("lr_scheduler", example="cosine")
    if name is not None:
        scheduler["kind"] = _SCHEDULERS.get(name, "constant")
        if name not in _SCHEDULERS:
            conversion.not_converted.append(
                (
                    "lr_scheduler",
                    f"{shown(name)} is not a schedule Ferry has (cosine, linear, constant); constant is used",
                )
            )
    warmup, ratio = config.number("warmup_steps", example="10"), config.number("warmup_ratio", example="0.1")
    steps = config.integer("max_steps")
    ratio_key = "warmup_ratio"
    if warmup is not None and 0 < warmup < 1 and ratio is None:
        warmup, ratio, ratio_key = None, warmup, "warmup_steps"  # transformers reads one below 1 as a ratio
    if warmup is not None:
        if not warmup.is_integer() or warmup < 0:
            raise ValueError(
                f"warmup_steps: must be a whole number of steps, e.g. warmup_steps: 10; got {shown(warmup)}"
            )
        scheduler["warmup_steps"] = int(warmup)
    elif ratio and steps:
        scheduler["warmup_steps"] = round(ratio * steps)
    elif ratio:
        conversion.not_converted.append(
            (
                ratio_key,
                "a ratio of the run: Ferry warms up for a number of steps; set warmup_steps (no max_steps to scale)",
            )
        )
    return scheduler


def _eval(config: AxolotlConfig, conversion: AxolotlConversion) -> dict[str, Any] | None:
    size = config.number("val_set_size", example="0.05")
    if not size:
        return None
    evaluation: dict[str, Any] = {"split": size}
    evaluation |= _every_steps(config, conversion, "eval_steps", "eval.every_steps")
    patience = config.integer("early_stopping_patience", example=3)
    if patience:
        evaluation["early_stopping"] = {"patience": patience}
    return evaluation


def _checkpoint(config: AxolotlConfig, conversion: AxolotlConversion) -> dict[str, Any] | None:
    checkpoint = _every_steps(config, conversion, "save_steps", "checkpoint.every_steps")
    keep = config.integer("save_total_limit", example=2)
    if keep:
        checkpoint["keep_last"] = keep
    return checkpoint or None


def _every_steps(config: AxolotlConfig, conversion: AxolotlConversion, key: str, setting: str) -> dict[str, Any]:
    """``{every_steps: n}`` from axolotl's ``key`` (eval_steps, save_steps), which may also be a fraction of the
    run: that is listed as not converted, since Ferry's ``setting`` counts steps."""
    every = config.number(key, example="100")
    if every and every >= 1:
        return {"every_steps": int(every)}
    if every:
        conversion.not_converted.append((key, f"a fraction of the run is not a step count; set {setting}"))
    return {}


def _tracking(config: AxolotlConfig) -> dict[str, Any] | None:
    project = config.text("wandb_project", example="my-project")
    mode = config.text("wandb_mode", example="offline")
    if not project:
        return None
    return {"wandb": {"project": project, "mode": "online" if mode == "online" else "offline"}}


def _list_the_rest(config: AxolotlConfig, conversion: AxolotlConversion) -> None:
    """Every key no section read: listed with its reason, unless its value turns off what Ferry does not do."""
    for key in config.unread():
        why = reason_for(key)
        if why != UNKNOWN and asks_for_nothing(config.raw(key)):
            continue
        conversion.not_converted.append((key, why))
    listed = {key for key, _ in conversion.not_converted}
    conversion.mapped = {key for key in config.keys() if key not in listed}  # noqa: SIM118 - not a dict
