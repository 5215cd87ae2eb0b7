"""Prompt rows (``data.format: prompt``, for ``training.objective: grpo``): TRL's prompt-only format and OpenAI's
reinforcement rows.

A row is ``{"prompt": "..."}`` (standard: the text as is), ``{"prompt": [{"role", "content"}, ...]}`` or OpenAI's
``{"messages": [...]}`` ending before the assistant's reply (conversational: rendered with the chat template and
its generation prompt). Its other columns are the graders' (``{{item.answer}}``); nothing here trains on them.
"""

from __future__ import annotations

from typing import Any

from jobs.data.formats.chat import check_messages, conversation_prompt
from jobs.data.formats.examples import IGNORE, Example, RecordError
from jobs.data.formats.trl import layout_refusal
from jobs.data.tokenizers import HFTokenizer, Tokenizer


def prompt_ids(fields: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """The token ids of a row's prompt (the chat template's generation prompt after a conversation).

    Raises:
        RecordError: naming the field: no prompt, a malformed conversation, one ending with the assistant's turn.
    """
    field = "prompt" if "prompt" in fields else "messages"
    prompt = fields.get(field)
    if isinstance(prompt, str):
        if not prompt:
            raise RecordError(field, "is empty; a prompt row needs the text to complete")
        return tokenizer.encode(prompt)
    if prompt is None:  # another TRL layout (language modeling, preference, ...) is named with what trains it
        raise layout_refusal(fields, "prompt", "prompt") or RecordError(
            "prompt", 'is missing; a prompt row is {"prompt": text or messages} or OpenAI\'s {"messages": [...]}'
        )
    messages = check_messages(prompt, field, need_assistant=False)
    if messages[-1]["role"] == "assistant":
        place, why = f"{field}[{len(messages) - 1}]", "is the assistant's; a prompt ends before the reply"
        layout = layout_refusal(fields, "prompt", "prompt") if field == "messages" else None
        # TRL's conversational language modeling: named too, with the setting that trains it
        raise RecordError(place, f"{why}; {layout.message}" if layout else why)
    if not isinstance(tokenizer, HFTokenizer):
        raise RecordError(field, "conversational prompts need data.tokenizer kind hf (a chat template)")
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return tokenizer.encode(conversation_prompt(plain, tokenizer))


def prompt_example(fields: dict[str, Any], tokenizer: Tokenizer) -> Example:
    """A prompt row as an example with no trained tokens: what the submit-time row check reads."""
    ids = prompt_ids(fields, tokenizer)
    return Example(ids, [IGNORE] * len(ids))
