"""ShareGPT's layout of a conversation, read as chat messages under ``data.format: chat``.

A ShareGPT record holds ``conversations``: a list of ``{from, value}`` where ``from`` is ``human``, ``gpt``
or ``system`` (``user``, ``assistant`` and ``tool`` are taken as they are). Each turn becomes the
``{role, content}`` message the chat format trains on, so the loss falls on the ``gpt`` turns only.
"""

from __future__ import annotations

from typing import Any

from jobs.data.formats.examples import RecordError

FIELD = "conversations"
ROLES = {
    "human": "user",
    "gpt": "assistant",
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def is_sharegpt(fields: dict[str, Any], messages_field: str) -> bool:
    """Whether a record holds ShareGPT turns: ``conversations`` in place of ``messages_field``, or turns
    under ``messages_field`` spelled ``{from, value}``."""
    if messages_field not in fields:
        return FIELD in fields
    turns = fields[messages_field]
    return isinstance(turns, list) and any(isinstance(t, dict) and "from" in t and "role" not in t for t in turns)


def sharegpt_messages(fields: dict[str, Any], messages_field: str) -> tuple[list[dict[str, Any]], str]:
    """The record's turns as chat messages, and the field that held them.

    Raises:
        RecordError: naming the offending turn, e.g. ``conversations[2].from``.
    """
    field = messages_field if messages_field in fields else FIELD
    turns = fields.get(field)
    if not isinstance(turns, list) or not turns:
        raise RecordError(field, f"must be a non-empty list of {{from, value}} objects; got {_shown(turns)}")
    messages = []
    for index, turn in enumerate(turns):
        where = f"{field}[{index}]"
        if not isinstance(turn, dict):
            raise RecordError(where, f"must be an object with from and value; got {_shown(turn)}")
        speaker, value = turn.get("from"), turn.get("value")
        if speaker not in ROLES:
            raise RecordError(f"{where}.from", f"must be one of {', '.join(ROLES)}; got {_shown(speaker)}")
        if not isinstance(value, str):
            raise RecordError(f"{where}.value", f"must be a string; got {_shown(value)}")
        message = {"role": ROLES[speaker], "content": value}
        if "weight" in turn:
            message["weight"] = turn["weight"]
        messages.append(message)
    return messages, field


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
