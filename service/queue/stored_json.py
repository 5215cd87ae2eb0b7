"""The JSON text the store writes: strict RFC 8259, so SQLite's json functions can read every row.

Python's ``json.dumps`` writes a NaN or infinite float as the bare tokens ``NaN`` / ``Infinity``, which are not
JSON: SQLite's ``json_extract`` then refuses the whole row ("malformed JSON"), and one diverged step (a NaN
loss) made every query over the job's events fail (the OpenAI checkpoints list answered 500, the step-event
retention stopped). A non-finite figure is stored as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``
instead: pydantic reads those strings back as the float (so the typed events are unchanged), and the API writes
that float as ``null``. Code that reads a stored figure as raw JSON goes through ``finite``.
"""

from __future__ import annotations

import json
import math
from typing import Any

# What pydantic writes with ``ser_json_inf_nan="strings"``, and reads back as a float.
NON_FINITE = frozenset({"NaN", "Infinity", "-Infinity"})


def stored_json(data: Any) -> str:
    """``data`` as strict JSON text, non-ASCII kept, a non-finite float as its string (see the module)."""
    try:
        return json.dumps(data, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere: rare, so the walk is paid only then
        return json.dumps(_finite_tree(data), ensure_ascii=False, allow_nan=False)


def finite(value: Any) -> float | None:
    """A stored figure as a finite float, or None: None, a non-finite float and its stored string all read None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _finite_tree(data: Any) -> Any:
    if isinstance(data, float) and not math.isfinite(data):
        return "NaN" if math.isnan(data) else ("Infinity" if data > 0 else "-Infinity")
    if isinstance(data, dict):
        return {key: _finite_tree(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [_finite_tree(value) for value in data]
    return data
