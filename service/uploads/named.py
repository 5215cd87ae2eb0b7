"""Which uploaded files a resolved spec names: every string under the uploads directory whose first part is an
upload's id (the checker resolved each data path, so a spec naming ``file-ab12`` reads ``<uploads>/file-ab12``).

Example:
    uploads_named_at({"data": {"path": "/srv/ferry/uploads/file-ab12"}}, Path("/srv/ferry/uploads"))
    # {"file-ab12": "data.path"}
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_UPLOAD_ID = re.compile(r"file-[0-9a-f]{1,64}")


def uploads_named(spec: dict[str, Any], uploads_dir: Path) -> set[str]:
    """The ids of the uploaded files a resolved spec names."""
    return set(uploads_named_at(spec, uploads_dir))


def uploads_named_at(spec: dict[str, Any], uploads_dir: Path) -> dict[str, str]:
    """``uploads_named``, each id with the first spec path that names it (``data.path``, ``eval.path``)."""
    prefix = f"{uploads_dir.resolve()}/"
    named: dict[str, str] = {}
    for path, text in _strings(spec, ""):
        if text.startswith(prefix):
            first = text[len(prefix) :].split("/", 1)[0]
            if _UPLOAD_ID.fullmatch(first):
                named.setdefault(first, path)
    return named


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string in ``value`` with its dotted path (``data.sources.0.path``)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}.{index}" if path else str(index))
