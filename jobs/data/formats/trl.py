"""TRL's dataset layouts (https://huggingface.co/docs/trl/dataset_formats) as Ferry reads them.

- Conversational prompt-completion (``{"prompt": [messages], "completion": [messages]}``) trains under
  ``data.format: chat``: the two lists are one conversation, and the loss falls on the completion's
  assistant turns only (TRL's completion-only loss; a tool result inside the completion is context, as in
  any chat record). An assistant turn inside the prompt is context too, unless ``train_on_prompt``.
- Standard prompt-completion (strings) is plain text: refused under ``chat``, with the ``instruction``
  settings that read it as TRL does (prompt, then completion and EOS, no template).
- Implicit-prompt preference (``chosen`` / ``rejected`` holding whole conversations, no ``prompt``),
  unpaired preference (``prompt`` / ``completion`` / ``label``, KTO's) and stepwise supervision
  (``prompt`` / ``completions`` / ``labels``) are refused, each naming its layout and what to convert it to.
  Standard preference strings are read in preference.py; prompt-only rows are GRPO's (``data.format:
  prompt``).
- A record in a layout the job's ``data.format`` does not read is refused naming its layout and the
  settings that train it (`layout_refusal`), never read as another layout's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobs.data.formats.chat import check_messages
from jobs.data.formats.examples import RecordError

IMPLICIT_PROMPT = (
    "is missing: chosen and rejected without prompt is TRL's implicit-prompt preference layout (each holds the "
    "whole conversation); move the turns they share into prompt and keep only the differing last turn(s) in "
    "chosen and rejected ({prompt: [...], chosen: [{role: assistant, ...}], rejected: [...]}: TRL's "
    "trl.extract_prompt converts a dataset so)"
)
UNPAIRED = (
    "prompt, completion and label are TRL's unpaired preference layout (KTO's), which Ferry does not train; "
    "pair each prompt's preferred and dispreferred completions as {prompt, chosen, rejected} for "
    "training.objective: dpo or orpo, or keep only the label-true rows without the label column to train "
    "them as prompt-completion chat data"
)


STEPWISE = (
    "prompt, completions and labels are TRL's stepwise supervision layout (a process reward model's steps), "
    "which Ferry does not train; keep each row's fully correct steps as one completion ({prompt, completion}, "
    "message lists, under data.format: chat) to train on them"
)
# Ferry's settings for each of TRL's layouts, standard (strings) and conversational (message lists).
_TRAINED_WITH = {
    ("language modeling", False): "data.format: text (data.text_field: text)",
    ("language modeling", True): "data.format: chat",
    ("prompt-only", False): "data.format: prompt with training.objective: grpo (which generates the completions)",
    ("prompt-only", True): "data.format: prompt with training.objective: grpo (which generates the completions)",
    ("prompt-completion", False): (
        "data.format: instruction, data.fields: {instruction: prompt, output: completion} and "
        "data.prompt_template: '{instruction}'"
    ),
    ("prompt-completion", True): "data.format: chat",
    ("preference", False): "training.objective: dpo (or orpo) and data.format: preference",
    ("preference", True): "training.objective: dpo (or orpo) and data.format: preference",
}
_FORMAT_OF = {  # (standard, conversational): the data.format that reads each layout as it is, if any
    "language modeling": ("text", "chat"),
    "prompt-only": ("prompt", "prompt"),
    "prompt-completion": ("", "chat"),  # strings: instruction, once its fields name prompt and completion
    "preference": ("preference", "preference"),
}


def trl_layout(fields: dict[str, Any]) -> tuple[str, bool] | None:
    """(layout, conversational) of a record in one of TRL's dataset layouts, by its columns; None otherwise.

    Example:
        >>> trl_layout({"prompt": [{"role": "user", "content": "Hi"}]})
        ('prompt-only', True)
    """
    keys = {key for key, value in fields.items() if value is not None}
    conversational = any(
        isinstance(fields.get(k), list) and any(isinstance(m, dict) for m in fields[k])
        for k in ("messages", "prompt", "completion", "chosen", "rejected")
    )
    if {"completions", "labels"} <= keys:
        return "stepwise supervision", conversational
    if {"completion", "label"} <= keys:
        return "unpaired preference", conversational
    if {"chosen", "rejected"} <= keys:
        return ("preference" if "prompt" in keys else "implicit-prompt preference"), conversational
    if "prompt" in keys:
        return ("prompt-completion" if "completion" in keys else "prompt-only"), conversational
    if keys & {"messages", "text"}:
        return "language modeling", "messages" in keys
    return None


def layout_refusal(fields: dict[str, Any], data_format: str, field: str) -> RecordError | None:
    """The refusal for a record in a TRL layout that ``data_format`` does not read, naming the layout and the
    settings that train it (or what to convert it to); None when the record is in no such layout.

    ``field`` is the field ``data_format`` looked for and did not find."""
    found = trl_layout(fields)
    if found is None:
        return None
    layout, conversational = found
    if layout == "stepwise supervision":
        return RecordError("labels", STEPWISE)
    if layout == "unpaired preference":
        return RecordError("label", UNPAIRED)
    if layout == "implicit-prompt preference":
        return RecordError("prompt", IMPLICIT_PROMPT)
    if _FORMAT_OF[layout][conversational] == data_format:
        return None  # the format's own layout: its reader names what is wrong inside the record
    kind = "conversational" if conversational else "standard"
    return RecordError(
        field,
        f"is missing: the record is in TRL's {kind} {layout} layout (it has {', '.join(sorted(fields))}), which "
        f"data.format: {data_format} does not read as set; train it with {_TRAINED_WITH[layout, conversational]}",
    )


@dataclass(frozen=True)
class Conversation:
    """A record's checked messages and the name of each, for errors (``completion[0]``)."""

    messages: list[dict[str, Any]]
    places: list[str]


def is_prompt_completion(fields: dict[str, Any], messages_field: str) -> bool:
    """Whether a chat record is in one of TRL's prompt/completion layouts instead of ``messages_field``."""
    return fields.get(messages_field) is None and fields.get("completion") is not None


def prompt_completion(fields: dict[str, Any], *, train_on_prompt: bool) -> Conversation:
    """A conversational prompt-completion record as one conversation, the prompt as context.

    Raises:
        RecordError: an unpaired preference row (``label``), string fields, or malformed messages.
    """
    if fields.get("label") is not None:
        raise RecordError("label", UNPAIRED)
    prompt, completion = fields.get("prompt"), fields.get("completion")
    if isinstance(prompt, str) or isinstance(completion, str):
        raise RecordError(
            "prompt" if isinstance(prompt, str) else "completion",
            "is a string: string prompt and completion are TRL's standard prompt-completion layout, plain text "
            "with no chat template; train it with data.format: instruction, data.fields: {instruction: prompt, "
            "output: completion} and data.prompt_template: '{instruction}', or give both as message lists",
        )
    before = check_messages(prompt, "prompt", need_assistant=False)
    after = check_messages(completion, "completion")
    if not train_on_prompt:  # TRL's completion-only loss: nothing in the prompt trains
        before = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in before]
    places = [f"prompt[{i}]" for i in range(len(before))] + [f"completion[{i}]" for i in range(len(after))]
    return Conversation(before + after, places)


def refuse_preference_in_chat(fields: dict[str, Any], messages_field: str) -> None:
    """A preference row read as chat data would train on the rejected answer too: refuse it, naming the layout.

    Raises:
        RecordError: the row holds ``chosen`` and ``rejected`` and no ``messages_field``.
    """
    if fields.get(messages_field) is None and fields.get("chosen") is not None and fields.get("rejected") is not None:
        layout = (
            "TRL's preference layout" if fields.get("prompt") is not None else "TRL's implicit-prompt preference layout"
        )
        raise RecordError(
            "chosen",
            f"chosen and rejected make a preference pair ({layout}), not chat data; train it with "
            "training.objective: dpo (or orpo) and data.format: preference",
        )
