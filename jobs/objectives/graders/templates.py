"""OpenAI's grader templates filled in: ``{{sample.output_text}}``, ``{{sample.output_json.<key>}}`` and
``{{item.<column>}}`` (``{{item.a.b}}`` for a nested column), as jobs/spec/graders.py admits them."""

from __future__ import annotations

import json
import re
from typing import Any

from jobs.spec.graders import TEMPLATE


def sample_of(completion: str) -> dict[str, Any]:
    """The ``sample`` a grader reads: the completion's text and, where it parses, its JSON (else None)."""
    try:
        parsed: Any = json.loads(completion)
    except ValueError:
        parsed = None
    return {"output_text": completion, "output_json": parsed}


def render(template: str, completion: str, row: dict[str, Any]) -> str:
    """``template`` with its placeholders filled in; a column the row lacks raises ``KeyError`` naming it."""
    scopes = {"sample": sample_of(completion), "item": row}

    def fill(match: re.Match[str]) -> str:
        scope, *path = match.group(1).split(".")
        value: Any = scopes[scope]
        for depth, key in enumerate(path):
            if not isinstance(value, dict) or key not in value:
                where = ".".join([scope, *path[: depth + 1]])
                has = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise KeyError(f"{where}: not in the {'row' if scope == 'item' else 'sample'} (it has {has})")
            value = value[key]
        return value if isinstance(value, str) else json.dumps(value)

    return TEMPLATE.sub(fill, template)
