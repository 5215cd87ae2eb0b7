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


def greedy_completion(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    eos_id: int | None,
    context: int,
    device: torch.device,
    accelerator: Any,
) -> list[int]:
    """The argmax continuation of ``prompt_ids`` (at most ``max_new_tokens``, stopping at EOS).

    No KV cache: every step runs the whole window. Under model offload each forward streams every weight
    anyway, which costs far more than recomputing a few hundred tokens, and a plain forward works for
    every model kind (built-in, Hugging Face, peft-wrapped) alike.
    """
    ids = list(prompt_ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = torch.tensor([ids[-context:]], device=device)
            with accelerator.autocast():
                output = model(input_ids=window)
            logits = output if isinstance(output, torch.Tensor) else output.logits
            token = int(logits[0, -1].argmax())  # CPU-GPU sync point, once per generated token
            if token == eos_id:
                break
            ids.append(token)
            new.append(token)
    return new


def generate_samples(
    model: nn.Module, spec: Any, tokenizer: Tokenizer, *, device: torch.device, accelerator: Any
) -> list[dict[str, str]]:
    """``{prompt, completion}`` for each of ``spec.text_samples.prompts`` (greedy, so the same weights give the same text)."""
    model.eval()
    try:
        samples = []
        for prompt in spec.text_samples.prompts:
            ids = tokenizer.encode(prompt_text(prompt, spec.data, tokenizer))
            new = greedy_completion(
                model,
                ids,
                max_new_tokens=spec.text_samples.max_new_tokens,
                eos_id=tokenizer.eos_id,
                context=spec.data.seq_len,
                device=device,
                accelerator=accelerator,
            )
            samples.append({"prompt": prompt_label(prompt), "completion": tokenizer.decode(new)})
        return samples
    finally:
        model.train()
