"""The formula of a multi grader's ``calculate_output`` (OpenAI's): arithmetic over its graders' rewards by name.

Numbers, the graders' names, ``+ - * /``, ``^`` or ``**`` (power), parentheses and ``min max abs floor ceil exp sqrt
log``. Read with ``ast`` and evaluated node by node, never with ``eval``: the formula arrives in a spec over HTTP.

Example:
    >>> evaluate_formula("0.7 * exact + 0.3 * fuzzy", {"exact": 1.0, "fuzzy": 0.5})
    0.85
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": math.log,
}


def _parse(text: str) -> ast.expr:
    # OpenAI writes a power as ^; Python's ^ is xor, which a reward formula never means.
    return ast.parse(text.replace("^", "**"), mode="eval").body


def formula_problem(text: str, names: list[str]) -> str | None:
    """Why ``text`` is no formula over ``names``, or None."""
    try:
        tree = _parse(text)
    except SyntaxError as error:
        return f"is no formula: {error.msg} in {text!r}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in names and node.id not in _FUNCTIONS:
            return f"names {node.id!r}, which is no grader of this multi grader ({', '.join(names)})"
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS):
            return f"calls something other than {', '.join(_FUNCTIONS)}"
        allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Call, ast.Name, ast.Constant, ast.Load)
        if not isinstance(node, allowed + tuple(_BINARY) + (ast.USub, ast.UAdd)):
            return f"may hold numbers, grader names, + - * / ^ and {', '.join(_FUNCTIONS)}; got {type(node).__name__}"
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
            return f"may hold numbers, not {node.value!r}"
    return None


def evaluate_formula(text: str, values: dict[str, float]) -> float:
    """``text`` (checked by ``formula_problem``) with each grader's name bound to its reward."""
    return float(_value(_parse(text), values))


def _value(node: ast.expr, values: dict[str, float]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _value(node.operand, values)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_value(node.left, values), _value(node.right, values))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return _FUNCTIONS[node.func.id](*(_value(arg, values) for arg in node.args))
    raise ValueError(f"calculate_output: cannot evaluate {ast.dump(node)}")
