"""Rules that span spec sections. Each returns the problems it finds so all are reported together."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobs.models.names import builtin_module_names, lora_target_matches

if TYPE_CHECKING:
    from jobs.spec import JobSpec

Problem = tuple[str, str]  # (dotted path, message)
BYTE_VOCAB = 257
_DATA_FOR_MODEL = {"toy_mlp": "synthetic_regression", "transformer_lm": "text", "hf_causal_lm": "text"}


def _check_data_fits_model(spec: JobSpec) -> list[Problem]:
    wanted = _DATA_FOR_MODEL[spec.model.kind]
    if spec.data.kind != wanted:
        return [("data.kind", f"model.kind={spec.model.kind} trains on data.kind={wanted}; got {spec.data.kind}")]
    return []


def _check_epochs_need_finite_data(spec: JobSpec) -> list[Problem]:
    if spec.training.epochs is not None and spec.data.kind == "synthetic_regression":
        return [("training.epochs", "synthetic_regression has no end; use training.steps instead")]
    return []


def _check_tokenizer_fits_vocab(spec: JobSpec) -> list[Problem]:
    if spec.model.kind != "transformer_lm" or spec.data.kind != "text":
        return []
    problems = []
    if spec.data.tokenizer.kind == "byte" and spec.model.vocab_size < BYTE_VOCAB:
        problems.append(
            ("model.vocab_size", f"the byte tokenizer needs vocab_size >= {BYTE_VOCAB}; got {spec.model.vocab_size}")
        )
    if spec.data.seq_len > spec.model.max_seq_len:
        problems.append(
            ("data.seq_len", f"must be <= model.max_seq_len ({spec.model.max_seq_len}); got {spec.data.seq_len}")
        )
    return problems


def _check_lora_targets_exist(spec: JobSpec) -> list[Problem]:
    if spec.lora is None or spec.model.kind == "hf_causal_lm":  # an HF model's names are known only on load
        return []
    names = builtin_module_names(spec.model)
    missing = [t for t in spec.lora.target_modules if not any(lora_target_matches(n, t) for n in names)]
    if missing:
        examples = ", ".join(sorted({_without_block_index(n) for n in names})[:12])
        return [
            (
                "lora.target_modules",
                f"{missing} match no Linear module of {spec.model.kind} (names end in e.g.: {examples})",
            )
        ]
    return []


def _without_block_index(name: str) -> str:
    """``blocks.3.attn.to_q`` → ``attn.to_q``: one example per kind of module."""
    parts = name.split(".")
    return ".".join(parts[2:]) if len(parts) > 2 and parts[1].isdigit() else name


def _check_checkpointing_supported(spec: JobSpec) -> list[Problem]:
    if spec.training.gradient_checkpointing and spec.model.kind == "toy_mlp":
        return [("training.gradient_checkpointing", "toy_mlp does not support it; set it to false")]
    return []


def _check_precision_fits_device(spec: JobSpec) -> list[Problem]:
    if spec.device == "cpu" and spec.training.mixed_precision == "fp16":
        return [("training.mixed_precision", "fp16 needs a CUDA device; use bf16 or no with device: cpu")]
    return []


def _check_warmup_fits_steps(spec: JobSpec) -> list[Problem]:
    steps, warmup = spec.training.steps, spec.training.scheduler.warmup_steps
    if steps is not None and warmup > steps:
        return [("training.scheduler.warmup_steps", f"must be <= training.steps ({steps}); got {warmup}")]
    return []


RULES = (
    _check_data_fits_model,
    _check_epochs_need_finite_data,
    _check_tokenizer_fits_vocab,
    _check_lora_targets_exist,
    _check_checkpointing_supported,
    _check_precision_fits_device,
    _check_warmup_fits_steps,
)


def cross_section_problems(spec: JobSpec) -> list[Problem]:
    """Every cross-section problem of ``spec``; empty when the combination is valid."""
    return [problem for rule in RULES for problem in rule(spec)]
