"""What a chat template keeps of a conversation: tool calls, tool results, the tools list, reasoning.

A Jinja template reads only the keys it was written for and ignores the rest without a word: a template
without tool support renders an assistant tool call as an empty answer, one without a reasoning block drops
``reasoning_content``. Training on that rendering trains on other data than the user's. So the conversation
is rendered and searched for each of these pieces; a piece that is not in the text refuses the record,
naming the field and the fix, instead of being trained on without it.

Reasoning has several spellings (Qwen3's templates read ``reasoning_content``, gpt-oss's ``thinking``):
the record's own key is tried first, then the others, and the first under which the template renders every
reasoning text is the one given to the template.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from jobs.data.formats.examples import RecordError
from jobs.data.formats.tools import tool_name

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
TEMPLATE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", *REASONING_KEYS)
TOOL_TEMPLATES = "Qwen2.5's and Qwen3's render tools, tool_calls and tool results"

Render = Callable[[list[dict[str, Any]]], str]  # messages -> the whole conversation's text


def reasoning_of(message: dict[str, Any]) -> tuple[str, str] | None:
    """(key, text) of a checked message's reasoning, or None."""
    for key in REASONING_KEYS:
        if key in message:
            return key, message[key]
    return None


def template_messages(
    messages: list[dict[str, Any]], places: list[str], render: Render, *, each_turn: bool = False
) -> list[dict[str, Any]]:
    """The checked messages as the template reads them (no ``weight``), reasoning under a key it renders.

    A turn's reasoning must be in the whole conversation's text, or, with ``each_turn`` (each assistant turn
    trains on the conversation up to it: turns.py), in the text of the conversation up to that turn.

    Raises:
        RecordError: no key puts some message's reasoning into the text.
    """
    own = [{key: m[key] for key in TEMPLATE_KEYS if key in m} for m in messages]
    thinking = [i for i, m in enumerate(messages) if (r := reasoning_of(m)) is not None and r[1].strip()]
    if not thinking:
        return own
    tried = [own] + [[_reasoning_under(m, key) for m in own] for key in REASONING_KEYS]
    for candidate in tried:
        text = render(candidate)
        shown = (lambda i, c=candidate: render(c[: i + 1])) if each_turn else (lambda i, t=text: t)
        if all(_appears(reasoning_of(candidate[i])[1].strip(), shown(i)) for i in thinking):  # type: ignore[index]
            return candidate
    raise _reasoning_problem(tried, thinking, places, render, each_turn)


def check_rendered(
    messages: list[dict[str, Any]],
    places: list[str],
    tools: list[dict[str, Any]] | None,
    render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str],
    tools_field: str,
) -> None:
    """Refuse a template that leaves out a tool call, a tool result or the ``tools`` list of a conversation.

    ``render(messages, tools)`` is the whole conversation's text. A tool call or the tools list counts as
    rendered when taking it away changes the text (its name alone could come from elsewhere: the tools
    list names every function a call names), and a call's argument values must be in the text.

    Raises:
        RecordError: naming the first piece missing and how to keep it.
    """
    text = render(messages, tools)
    for position, (message, place) in enumerate(zip(messages, places, strict=True)):
        calls = message.get("tool_calls") or []
        if calls:
            without = [
                *messages[:position],
                {k: v for k, v in message.items() if k != "tool_calls"},
                *messages[position + 1 :],
            ]
            ignored = render(without, tools) == text
            for index, call in enumerate(calls):
                missing = [p for p in _pieces(call["function"]["arguments"]) if not _appears(p, text)]
                if ignored or missing:
                    what = "the text is the same without it" if ignored else f"{missing[0]!r} is not in the text"
                    raise RecordError(
                        f"{place}.tool_calls[{index}]",
                        f"the chat template does not render this tool call ({what}), so it would train as an "
                        f"empty answer; set data.chat_template to one that renders tool_calls ({TOOL_TEMPLATES}), "
                        "or leave such rows out",
                    )
        if message["role"] == "tool" and message["content"].strip() and not _appears(message["content"].strip(), text):
            raise RecordError(
                f"{place}.content",
                "the chat template does not render this tool result; set data.chat_template to one that renders "
                f"role tool messages ({TOOL_TEMPLATES}), or leave such rows out",
            )
    if tools and render(messages, None) == text:
        names = ", ".join(repr(tool_name(t)) for t in tools)
        raise RecordError(
            tools_field,
            f"the chat template ignores the tools list (the text is the same without tools {names}); set "
            f"data.chat_template to one that renders tools ({TOOL_TEMPLATES}), or drop the {tools_field} column "
            "to train without tool definitions",
        )


def _reasoning_under(message: dict[str, Any], key: str) -> dict[str, Any]:
    found = reasoning_of(message)
    if found is None:
        return message
    moved = {k: v for k, v in message.items() if k not in REASONING_KEYS}
    moved[key] = found[1]
    return moved


def _reasoning_problem(
    tried: list[list[dict[str, Any]]], thinking: list[int], places: list[str], render: Render, each_turn: bool
) -> RecordError:
    """The refusal for reasoning no key renders: on an earlier turn only (Qwen3's template keeps reasoning
    after the last user message only), or nowhere (the template has no place for it)."""
    own = tried[0]
    first = next(
        i
        for i in thinking
        if not _appears(reasoning_of(own[i])[1].strip(), render(own[: i + 1] if each_turn else own))  # type: ignore[index]
    )
    key = reasoning_of(own[first])[0]  # type: ignore[index]
    field = f"{places[first]}.{key}"
    if any(_appears(reasoning_of(c[first])[1].strip(), render(c[: first + 1])) for c in tried):  # type: ignore[index]
        return RecordError(
            field,
            "the chat template renders reasoning on the last turns only (Qwen3's keeps it after the last user "
            "message), so this earlier turn's reasoning would be dropped; set data.chat_template to one that "
            "renders every turn's reasoning (TRL's qwen3_training.jinja does), or give each user question its "
            "own record",
        )
    return RecordError(
        field,
        f"the chat template has no place for reasoning text ({', '.join(REASONING_KEYS)} are not rendered), so it "
        "would be dropped; set data.chat_template to one that renders it (Qwen3's renders reasoning_content in "
        f"<think>), or remove {key} from the messages to train without it",
    )


def _pieces(value: Any) -> Iterator[str]:
    """The keys and scalar values of a tool call's arguments, as text the template may have written."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield str(key)
            yield from _pieces(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _pieces(inner)
    elif isinstance(value, bool):
        yield json.dumps(value)
    elif isinstance(value, (int, float, str)) and str(value):
        yield str(value)


def _appears(piece: str, text: str) -> bool:
    """``piece`` is in ``text`` as written, JSON-escaped (``| tojson``), or, for true/false, as Python spells it."""
    spellings = {piece, json.dumps(piece)[1:-1], json.dumps(piece, ensure_ascii=False)[1:-1]}
    if piece in ("true", "false"):
        spellings.add(piece.capitalize())
    return any(s in text for s in spellings)
