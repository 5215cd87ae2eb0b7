"""Pydantic's errors said in Ferry's words: what the field must be, what it got, and the fix.

Pydantic writes "Input should be a valid integer, unable to parse string as an integer" for ``steps: 1e3``
(YAML 1.1 reads ``1e3`` as a string); a user should read "must be a whole number; got 1e3 (write 1000)".
`loading.py` puts the field's path and YAML line in front of the message, so it starts with the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pydantic_core import ErrorDetails


def ferry_message(error: ErrorDetails) -> str:
    """The message for one pydantic error: Ferry's wording where the error's type is known, else pydantic's
    own (without its "Value error, " prefix, which a rule's ValueError gets)."""
    word = _WORDS.get(error["type"])
    if word is None:
        return error["msg"].removeprefix("Value error, ")
    return word(error["input"], error.get("ctx") or {})


def _shown(value: Any) -> str:
    """A value as the user wrote it in YAML: a number-like string bare (``1e3``), other strings quoted."""
    if isinstance(value, str):
        return value if _looks_numeric(value) else repr(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return str(value)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _as_float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _whole_number(value: Any, ctx: dict[str, Any]) -> str:
    number = _as_float(value) if isinstance(value, str) else value if isinstance(value, int | float) else None
    if number is not None and float(number).is_integer() and not isinstance(number, bool):
        return f"must be a whole number; got {_shown(value)} (write {int(number)})"
    if number is not None:
        return f"must be a whole number; got {_shown(value)} (round it)"
    return f"must be a whole number; got {_shown(value)}"


def _number(value: Any, ctx: dict[str, Any]) -> str:
    return f"must be a number (like 0.001 or 1.0e-3); got {_shown(value)}"


def _boolean(value: Any, ctx: dict[str, Any]) -> str:
    return f"must be true or false; got {_shown(value)}"


def _string(value: Any, ctx: dict[str, Any]) -> str:
    fix = " (quote it)" if isinstance(value, int | float) and not isinstance(value, bool) else ""
    return f"must be a string; got {_shown(value)}{fix}"


def _bound(rule: str, key: str) -> Callable[[Any, dict[str, Any]], str]:
    return lambda value, ctx: f"must be {rule} {ctx.get(key)}; got {_shown(value)}"


def _missing(value: Any, ctx: dict[str, Any]) -> str:
    return "is required; add it"


def _section(value: Any, ctx: dict[str, Any]) -> str:
    return f"must be a section (indented keys under it); got {_shown(value)}"


def _list(value: Any, ctx: dict[str, Any]) -> str:
    return f"must be a list (like [a, b]); got {_shown(value)}"


def _too_short(value: Any, ctx: dict[str, Any]) -> str:
    return f"must hold at least {ctx.get('min_length')} item(s); got {ctx.get('actual_length')}"


def _too_long(value: Any, ctx: dict[str, Any]) -> str:
    return f"must hold at most {ctx.get('max_length')} item(s); got {ctx.get('actual_length')}"


def _string_too_short(value: Any, ctx: dict[str, Any]) -> str:
    least = ctx.get("min_length")
    return "must not be empty" if least == 1 else f"must be at least {least} characters long; got {_shown(value)}"


def _string_too_long(value: Any, ctx: dict[str, Any]) -> str:
    return f"must be at most {ctx.get('max_length')} characters long; got {len(str(value))}"


def _finite(value: Any, ctx: dict[str, Any]) -> str:
    return f"must be a finite number; got {_shown(value)}"


def _tag_missing(value: Any, ctx: dict[str, Any]) -> str:
    return "needs a 'kind:' key naming which one it is; add it (python -m jobs schema lists the kinds)"


_WORDS: dict[str, Callable[[Any, dict[str, Any]], str]] = {
    "int_parsing": _whole_number,
    "int_from_float": _whole_number,
    "int_type": _whole_number,
    "float_parsing": _number,
    "float_type": _number,
    "bool_parsing": _boolean,
    "bool_type": _boolean,
    "string_type": _string,
    "missing": _missing,
    "greater_than": _bound("greater than", "gt"),
    "greater_than_equal": _bound("at least", "ge"),
    "less_than": _bound("less than", "lt"),
    "less_than_equal": _bound("at most", "le"),
    "multiple_of": _bound("a multiple of", "multiple_of"),
    "finite_number": _finite,
    "dict_type": _section,
    "model_type": _section,
    "model_attributes_type": _section,
    "list_type": _list,
    "too_short": _too_short,
    "too_long": _too_long,
    "string_too_short": _string_too_short,
    "string_too_long": _string_too_long,
    "union_tag_not_found": _tag_missing,
}
