"""Text samples during training: fixed prompts completed greedily, formatted as the training data is."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jobs.data.formats.record import instruction_prompt
from jobs.data.tokenizers import HFTokenizer, Tokenizer


def prompt_text(prompt: str | list[Any], data_spec: Any, tokenizer: Tokenizer) -> str:
    """``prompt`` as the model saw prompts in training: a chat user turn, an instruction, or plain text; chat
    messages (``[{role, content}, ...]``) rendered with the chat template, whatever the data's format."""
    if isinstance(prompt, list):
        from jobs.data.formats.chat import conversation_prompt

        assert isinstance(tokenizer, HFTokenizer)  # a rule refuses chat prompts without an HF tokenizer
        return conversation_prompt([{"role": m.role, "content": m.content} for m in prompt], tokenizer)
    if data_spec.format == "chat":
        from jobs.data.formats.chat import chat_prompt

        assert isinstance(tokenizer, HFTokenizer)
        return chat_prompt(prompt, tokenizer)
    if data_spec.format == "instruction":
        return instruction_prompt(prompt, "", data_spec)
    return prompt


def prompt_label(prompt: str | list[Any]) -> str:
    """How a prompt is shown with its sample: the string, or one ``role: content`` line per chat message."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.role}: {m.content}" for m in prompt)


END_OF_TURN_PROBE = "\u2063ferry-reply\u2063"  # a reply no template rewrites, found again in the rendered text


def stop_ids(tokenizer: Tokenizer, model: nn.Module | None = None) -> frozenset[int]:
    """The ids a sample stops at, as transformers' ``generate`` takes them from ``generation_config.eos_token_id``:
    the tokenizer's EOS, the model's ``generation_config`` EOS ids (an int or a list), and the chat template's
    end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``), which is often not the EOS: without it
    a chat sample runs on into the next turn ("ANSWER: Rome.ANSWER: Rome.")."""
    found = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    config = getattr(model, "generation_config", None) if model is not None else None
    configured = getattr(config, "eos_token_id", None)
    found.update([configured] if isinstance(configured, int) else list(configured or []))
    if isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template:
        turn = end_of_turn_id(tokenizer)
        if turn is not None:
            found.add(turn)
    return frozenset(int(i) for i in found)


def end_of_turn_id(tokenizer: HFTokenizer) -> int | None:
    """The special token the chat template writes right after an assistant reply, or None (a template that
    ends a turn in plain text, or that refuses the probe conversation)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": END_OF_TURN_PROBE}]
    try:
        text = tokenizer.render_chat(messages, add_generation_prompt=False)
    except Exception:  # a template with its own rules (a system turn first, ...): no end-of-turn id to add
        return None
    _, found, after = text.partition(END_OF_TURN_PROBE)
    ids = tokenizer.encode(after.lstrip(" ")) if found else []
    special = set(tokenizer.hf.all_special_ids) | set(tokenizer.hf.added_tokens_decoder)
    return ids[0] if ids and ids[0] in special else None


def greedy_completion(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    eos_id: int | frozenset[int] | None,
    context: int,
    device: torch.device,
    accelerator: Any,
) -> list[int]:
    """The argmax continuation of ``prompt_ids`` (at most ``max_new_tokens``, stopping at any of ``eos_id``).

    No KV cache: every step runs the whole window. Under model offload each forward streams every weight
    anyway, which costs far more than recomputing a few hundred tokens, and a plain forward works for
    every model kind (built-in, Hugging Face, peft-wrapped) alike.
    """
    stops = eos_id if isinstance(eos_id, frozenset) else frozenset([] if eos_id is None else [eos_id])
    ids = list(prompt_ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = torch.tensor([ids[-context:]], device=device)
            with accelerator.autocast():
                output = model(input_ids=window)
            logits = output if isinstance(output, torch.Tensor) else output.logits
            token = int(logits[0, -1].argmax())  # CPU-GPU sync point, once per generated token
            if token in stops:
                break
            ids.append(token)
            new.append(token)
    return new


def generate_samples(
    model: nn.Module, spec: Any, tokenizer: Tokenizer, *, device: torch.device, accelerator: Any
) -> list[dict[str, str]]:
    """``{prompt, completion}`` for each of ``spec.text_samples.prompts`` (greedy, so the same weights give the same text)."""
    model.eval()
    stops = stop_ids(tokenizer, model)
    try:
        samples = []
        for prompt in spec.text_samples.prompts:
            ids = tokenizer.encode(prompt_text(prompt, spec.data, tokenizer))
            new = greedy_completion(
                model,
                ids,
                max_new_tokens=spec.text_samples.max_new_tokens,
                eos_id=stops,
                context=spec.data.seq_len,
                device=device,
                accelerator=accelerator,
            )
            samples.append({"prompt": prompt_label(prompt), "completion": tokenizer.decode(new)})
        return samples
    finally:
        model.train()
