"""From a record to training tokens, by ``data.format``: text, instruction (alpaca-style), chat or preference.

Chat records are OpenAI's ``messages`` (tool calls and reasoning included), ShareGPT's ``conversations`` or
TRL's conversational ``prompt`` and ``completion``; a ``tools`` column goes to the chat template.

Labels are the token ids where the loss applies and -100 (PyTorch's and Hugging Face's ignore index)
where it does not: prompts, unless ``train_on_prompt``.
"""

from __future__ import annotations

from typing import Any

from jobs.data.formats.chat import chat_examples, check_messages
from jobs.data.formats.examples import IGNORE as IGNORE
from jobs.data.formats.examples import Example as Example
from jobs.data.formats.examples import RecordError as RecordError
from jobs.data.formats.sharegpt import is_sharegpt, sharegpt_messages
from jobs.data.formats.tools import check_tools
from jobs.data.formats.trl import (
    Conversation,
    is_prompt_completion,
    layout_refusal,
    prompt_completion,
    refuse_preference_in_chat,
)
from jobs.data.tokenizers import HFTokenizer, Tokenizer

ALPACA = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def record_examples(fields: dict[str, Any], spec: Any, tokenizer: Tokenizer) -> list[Example]:
    """The tokens and labels of one record of a ``data`` section (``spec``): one example, or for a chat
    record under a template that renders earlier turns differently from the last (Qwen3's), one per trained
    assistant turn (turns.py).

    Raises:
        RecordError: a field is missing or of the wrong type, or the chat template fails.
    """
    if spec.format == "text":
        ids = tokenizer.encode(_string(fields, spec.text_field, "data.text_field", "text")) + _eos(tokenizer)
        return [Example(ids, list(ids))]
    if spec.format == "instruction":
        prompt, response = instruction_texts(fields, spec)
        return [_prompt_and_response(tokenizer, prompt, response, spec.train_on_prompt)]
    if spec.format == "prompt":  # grpo's prompts: checked here at submit time, sampled from in training
        from jobs.data.formats.prompt import prompt_example

        return [prompt_example(fields, tokenizer)]
    assert isinstance(tokenizer, HFTokenizer)  # a rule refuses chat data without an HF tokenizer
    if spec.format == "preference":  # checked here at submit time; trained as pairs (jobs/data/formats/preference.py)
        from jobs.data.formats.preference import preference_pair

        pair = preference_pair(fields, tokenizer)
        return [pair.example(pair.chosen)]
    conversation = chat_conversation(fields, spec.messages_field, train_on_prompt=spec.train_on_prompt)
    return chat_examples(
        conversation.messages,
        tokenizer,
        train_on_prompt=spec.train_on_prompt,
        tools=check_tools(fields.get("tools")),
        places=conversation.places,
    )


def record_example(fields: dict[str, Any], spec: Any, tokenizer: Tokenizer) -> Example:
    """The one example of a record that makes one (see `record_examples`).

    Raises:
        RecordError: as `record_examples`.
        ValueError: the record makes several examples.
    """
    examples = record_examples(fields, spec, tokenizer)
    if len(examples) != 1:
        raise ValueError(f"the record makes {len(examples)} examples; read it with record_examples")
    return examples[0]


def chat_conversation(fields: dict[str, Any], messages_field: str, *, train_on_prompt: bool = False) -> Conversation:
    """A chat record's checked messages: OpenAI's ``messages``, ShareGPT's ``conversations`` (sharegpt.py) or
    TRL's conversational ``prompt`` and ``completion`` (trl.py, the prompt as context).

    Raises:
        RecordError: naming the offending field; a preference row is refused here (trl.py).
    """
    if is_sharegpt(fields, messages_field):
        turns, field = sharegpt_messages(fields, messages_field)
        return _named(check_messages(turns, field), field)
    refuse_preference_in_chat(fields, messages_field)
    if is_prompt_completion(fields, messages_field):
        return prompt_completion(fields, train_on_prompt=train_on_prompt)
    if fields.get(messages_field) is None and (refusal := layout_refusal(fields, "chat", messages_field)):
        raise refusal
    return _named(check_messages(fields.get(messages_field), messages_field), messages_field)


def _named(messages: list[dict[str, Any]], field: str) -> Conversation:
    return Conversation(messages, [f"{field}[{i}]" for i in range(len(messages))])


def instruction_texts(fields: dict[str, Any], spec: Any) -> tuple[str, str]:
    """(prompt, response) of an instruction record."""
    names = spec.fields
    instruction = _string(fields, names.instruction, "data.fields.instruction", "instruction")
    extra = fields.get(names.input)
    if extra is not None and not isinstance(extra, str):
        raise RecordError(names.input, f"must be a string when present; got {type(extra).__name__}")
    return instruction_prompt(instruction, extra or "", spec), _string(
        fields, names.output, "data.fields.output", "instruction"
    )


def instruction_prompt(instruction: str, extra: str, spec: Any) -> str:
    """The prompt text: ``data.prompt_template`` or alpaca's, with ``{instruction}`` and ``{input}`` filled."""
    template = spec.prompt_template or (ALPACA if extra else ALPACA_NO_INPUT)
    # str.replace, not str.format: a template's other braces (JSON examples, code) stay as written.
    return template.replace("{instruction}", instruction).replace("{input}", extra)


def _prompt_and_response(tokenizer: Tokenizer, prompt: str, response: str, train_on_prompt: bool) -> Example:
    prompt_ids = tokenizer.encode(prompt)
    response_ids = tokenizer.encode(response) + _eos(tokenizer)  # the model learns to stop
    labels = (prompt_ids if train_on_prompt else [IGNORE] * len(prompt_ids)) + response_ids
    return Example(prompt_ids + response_ids, labels)


def _string(fields: dict[str, Any], name: str, setting: str, data_format: str) -> str:
    value = fields.get(name)
    if value is None:
        if (refusal := layout_refusal(fields, data_format, name)) is not None:
            raise refusal  # another layout's record: name it, not only the field
        present = ", ".join(sorted(fields)) or "none"
        raise RecordError(name, f"is missing (the record has: {present}); set {setting} to the right field name")
    if not isinstance(value, str):
        raise RecordError(name, f"must be a string; got {type(value).__name__}")
    return value


def _eos(tokenizer: Tokenizer) -> list[int]:
    return [tokenizer.eos_id] if tokenizer.eos_id is not None else []
