"""Tool use in chat records: an assistant turn's ``tool_calls`` and the record's ``tools`` list, checked.

Records arrive in OpenAI's layout: a tool call is ``{"type": "function", "id"?, "function": {"name",
"arguments"}}`` with ``arguments`` a JSON *string*, and ``tools`` is a list of ``{"type": "function",
"function": {"name", "description", "parameters"}}``. Hugging Face chat templates read the arguments as a
mapping (transformers' tool-use guide: "arguments should be a dict"; templates render them with
``| tojson``), so a string is parsed here, once, and a string that is not a JSON object is refused. A
``tools`` column held as a JSON string (as TRL accepts it) is parsed too.
"""

from __future__ import annotations

import json
from typing import Any

from jobs.data.formats.examples import RecordError

CALL_SHAPE = "{type: function, function: {name, arguments}}"


def check_tool_calls(value: Any, field: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls in the shape chat templates read, arguments as a mapping.

    ``None`` (absent, or the null a columnar file gives a message without calls) is no call.

    Raises:
        RecordError: naming the offending call, e.g. ``messages[1].tool_calls[0].function.arguments``.
    """
    if value is None:
        return []
    if not isinstance(value, list):
        raise RecordError(field, f"must be a list of {CALL_SHAPE} objects; got {_shown(value)}")
    return [_tool_call(call, f"{field}[{index}]") for index, call in enumerate(value)]


def check_tools(value: Any, field: str = "tools") -> list[dict[str, Any]] | None:
    """The record's tool definitions, or None when it has none (absent, null or an empty list).

    Raises:
        RecordError: the list is not JSON, not a list of objects, or a tool has no name.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RecordError(
                field, f"must be a list of tool definitions (or a JSON string of one); got {_shown(value)}"
            ) from None
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise RecordError(
            field, f"must be a list of {{type: function, function: {{name, parameters}}}}; got {_shown(value)}"
        )
    for index, tool in enumerate(value):
        if not tool_name(tool):
            where = f"{field}[{index}].function.name" if "function" in tool else f"{field}[{index}].name"
            raise RecordError(
                where, "is missing; every tool needs a name (OpenAI's {type: function, function: {name, ...}})"
            )
    return value


def tool_name(tool: dict[str, Any]) -> str | None:
    """The name of a tool definition: OpenAI's ``{function: {name}}`` or a bare JSON schema's ``{name}``."""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) and name else None


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise RecordError(where, f"must be an object {CALL_SHAPE}; got {_shown(call)}")
    kind = call.get("type")
    if kind not in (None, "function"):
        raise RecordError(
            f"{where}.type", f"must be 'function' (the only kind chat templates render); got {_shown(kind)}"
        )
    # transformers accepts a bare {name, arguments} too; templates unwrap ``function`` when it is there.
    function, place = (call["function"], f"{where}.function") if call.get("function") is not None else (call, where)
    if not isinstance(function, dict):
        raise RecordError(place, f"must be an object with name and arguments; got {_shown(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise RecordError(f"{place}.name", f"must be the called function's name; got {_shown(name)}")
    checked: dict[str, Any] = {
        "type": "function",
        "function": {"name": name, "arguments": _arguments(function.get("arguments"), f"{place}.arguments")},
    }
    if isinstance(call.get("id"), str):  # some templates (Mistral's) render the call's id
        checked["id"] = call["id"]
    return checked


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as error:
            raise RecordError(
                where, f"is a string but not JSON ({error}); write the arguments as a JSON object"
            ) from None
    if not isinstance(value, dict):
        raise RecordError(
            where, f"must be a JSON object (or a string of one, as OpenAI writes it); got {_shown(value)}"
        )
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
