"""TRL's dataset layouts (https://huggingface.co/docs/trl/dataset_formats) as Ferry reads them.

- Conversational prompt-completion (``{"prompt": [messages], "completion": [messages]}``) trains under
  ``data.format: chat``: the two lists are one conversation, and the loss falls on the completion's
  assistant turns only (TRL's completion-only loss; a tool result inside the completion is context, as in
  any chat record). An assistant turn inside the prompt is context too, unless ``train_on_prompt``.
- Standard prompt-completion (strings) is plain text: refused under ``chat``, with the ``instruction``
  settings that read it as TRL does (prompt, then completion and EOS, no template).
- Implicit-prompt preference (``chosen`` / ``rejected`` holding whole conversations, no ``prompt``) and
  unpaired preference (``prompt`` / ``completion`` / ``label``, KTO's) are refused, each naming its layout
  and what to convert it to. Standard preference strings are read in preference.py.
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
