"""Cross-section rules of language-model fine-tuning: formats, objectives, packing, eval, samples, LoRA variants."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobs.errors import Problem
from jobs.models.registry import family_of

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec


def _check_chat_needs_hf_tokenizer(spec: JobSpec) -> list[Problem]:
    data = spec.data
    if data.kind == "text" and data.format in ("chat", "preference") and data.tokenizer.kind != "hf":
        return [
            (
                "data.tokenizer",
                f"data.format: {data.format} renders messages with a chat template; use {{kind: hf, path: ...}}",
            )
        ]
    return []


def _check_chat_template_only_for_chat(spec: JobSpec) -> list[Problem]:
    data = spec.data
    chat_prompts = spec.text_samples is not None and spec.text_samples.has_chat_prompts()
    # Chat-message sample prompts are rendered with the template whatever the data's format.
    if (
        data.kind == "text"
        and data.chat_template is not None
        and data.format not in ("chat", "preference")
        and not chat_prompts
    ):
        message = f"only data.format: chat (or chat text_samples.prompts) uses a chat template; got {data.format}"
        return [("data.chat_template", message)]
    return []


def _check_chat_prompts_need_hf_tokenizer(spec: JobSpec) -> list[Problem]:
    samples = spec.text_samples
    if (
        samples is not None
        and samples.has_chat_prompts()
        and spec.data.kind == "text"
        and spec.data.tokenizer.kind != "hf"
    ):
        return [
            (
                "text_samples.prompts",
                "chat messages are rendered with a chat template; set data.tokenizer: {kind: hf, path: ...}",
            )
        ]
    return []


def _check_packing_fits_model(spec: JobSpec) -> list[Problem]:
    keeps_apart = family_of(spec.model).keeps_packed_documents_apart
    if spec.data.kind == "text" and spec.data.packing == "packed" and not keeps_apart:
        return [
            (
                "data.packing",
                f"{spec.model.kind} cannot keep packed documents apart (no position ids); use packing: padded or auto",
            )
        ]
    return []


def _check_eval_and_samples_need_text(spec: JobSpec) -> list[Problem]:
    family = family_of(spec.model)  # a family that reads its own data may evaluate and sample it itself
    own = {"eval": family.holds_out_eval, "text_samples": family.make_text_samples is not None}
    problems = []
    for name in ("eval", "text_samples"):
        if getattr(spec, name) is not None and spec.data.kind != "text" and not own[name]:
            problems.append((name, f"needs data.kind: text; {spec.data.kind} has no held-out text or prompts"))
    return problems


def _check_dora_under_offload(spec: JobSpec) -> list[Problem]:
    # DoRA reads the base layer's weight outside that layer's own forward (for its norm), so the weight
    # must stay on the device for the whole block: block granularity keeps it there.
    lora, offload = spec.lora, spec.offload
    if lora is not None and lora.use_dora and offload.enable_model_cpu_offload and offload.granularity != "block":
        return [("lora.use_dora", "with model offload DoRA needs offload.granularity: block")]
    return []


def _check_objective_fits_data(spec: JobSpec) -> list[Problem]:
    objective, data = spec.training.objective, spec.data
    prompts = data.kind == "text" and data.format == "prompt"
    if objective == "grpo" or prompts:
        return _check_grpo(spec, prompts)
    pairs = data.kind == "text" and data.format == "preference"
    if objective != "sft" and not pairs:
        return [
            (
                "training.objective",
                f"{objective} trains on preference pairs: set data.kind: text and data.format: preference "
                "(prompt, chosen, rejected; or OpenAI's input, preferred_output, non_preferred_output)",
            )
        ]
    if objective == "sft" and pairs:
        return [("data.format", "preference pairs train with training.objective: dpo or orpo; got sft")]
    return []


def _check_grpo(spec: JobSpec, prompts: bool) -> list[Problem]:
    """grpo samples from prompt-only rows and rewards with a grader; its KL reference is the base under LoRA."""
    grpo = spec.training.grpo
    if spec.training.objective != "grpo":
        return [("data.format", "prompt-only rows train with training.objective: grpo")]
    problems: list[Problem] = []
    if not prompts:
        problems.append(
            ("training.objective", "grpo samples completions of prompts: set data.kind: text and data.format: prompt")
        )
    if grpo.grader is None:
        problems.append(("training.grpo.grader", "grpo needs a grader to reward completions, e.g. string_check"))
    for name in ("eval", "text_samples"):
        if getattr(spec, name) is not None:
            problems.append(
                (
                    name,
                    "grpo jobs report rewards per step and do not evaluate; remove it "
                    "(training.grpo.samples_every_steps shows completions and their rewards)",
                )
            )
    if grpo.beta > 0 and spec.lora is None:
        problems.append(
            (
                "training.grpo.beta",
                "the KL reference is the base with the LoRA adapters off; a full fine-tune has none: set lora or beta: 0",
            )
        )
    if spec.lora is not None and grpo.beta > 0 and (spec.lora.use_dora or spec.lora.modules_to_save):
        problems.append(("lora", "grpo's reference turns plain LoRA adapters off; remove use_dora/modules_to_save"))
    return problems


def _check_preference_setup(spec: JobSpec) -> list[Problem]:
    """What preference tuning does not combine with (yet)."""
    objective, lora = spec.training.objective, spec.lora
    if objective in ("sft", "grpo"):
        return []
    problems: list[Problem] = []
    if objective == "dpo" and lora is not None and (lora.use_dora or lora.modules_to_save):
        field = "lora.use_dora" if lora.use_dora else "lora.modules_to_save"
        problems.append(
            (field, "dpo takes the reference from the base with plain LoRA adapters off; remove it for dpo")
        )
    if spec.data.kind == "text" and spec.data.packing == "packed":
        problems.append(("data.packing", "preference pairs are batched as padded pairs; use packing: auto"))
    return problems


RULES = (
    _check_objective_fits_data,
    _check_preference_setup,
    _check_chat_needs_hf_tokenizer,
    _check_chat_template_only_for_chat,
    _check_chat_prompts_need_hf_tokenizer,
    _check_packing_fits_model,
    _check_eval_and_samples_need_text,
    _check_dora_under_offload,
)
