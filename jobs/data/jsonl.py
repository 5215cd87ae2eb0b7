"""JSON Lines read one line at a time: the one reader of JSONL rows, for the upload check in the API process
(service/uploads/rows.py) and for a job's data (jobs/data/records.py), so a row one accepts the other reads
alike and a row one refuses the other refuses in the same words.

Standard library only: the API process imports it without torch or ``datasets``.

What it refuses, naming the 1-based line:

- a line longer than ``max_line_bytes`` (when given), found without holding the line: ``readline`` stops
  at the limit, so one line of a ``.json`` array export costs the limit, not the file's size (the parsed
  objects of a line take about ten times its bytes);
- a line that is not UTF-8, not JSON, or not a JSON object;
- an object with a key twice: ``json`` keeps the last value without a word and ``datasets`` split such a row
  into others, so the job would train on rows the file does not hold;
- nesting deeper than ``MAX_DEPTH`` levels: ``json`` would raise ``RecursionError`` (a 500 in the API), and
  code that walks a parsed value (a repr in an error message, a chat template) would hit it later.

Example:
    for line, row in read_jsonl(Path("train.jsonl"), max_line_bytes=4 << 20):
        ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from pathlib import Path
from typing import Any

MAX_DEPTH = 128  # a chat row nests about five levels; tool schemas a few more
_BOM = b"\xef\xbb\xbf"  # some editors and spreadsheet exports start the file with it
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, its escapes included
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = frozenset(b"[{")


class JsonlError(ValueError):
    """A line of a JSONL file that is not one row; ``line`` is 1-based, ``message`` says why and what to do."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line, self.message = line, message


class LineTooLong(JsonlError):
    """A line past ``limit`` bytes, refused before it was read whole."""

    def __init__(self, line: int, limit: int) -> None:
        super().__init__(line, f"is longer than {limit} bytes")
        self.limit = limit


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def read_jsonl(path: Path, *, max_line_bytes: int | None = None) -> Generator[tuple[int, dict[str, Any]], None, None]:
    """``(line number, row)`` for every non-blank line of ``path``, in order.

    Args:
        path: A JSON Lines file.
        max_line_bytes: Refuse a line with more bytes than this (its newline not counted); None reads any.

    Raises:
        LineTooLong: a line past ``max_line_bytes``.
        JsonlError: a line that is not one JSON object (see the module's docstring).
    """
    with path.open("rb") as lines:
        number = 0
        while True:
            # One byte past the limit tells a line of exactly `limit` bytes and its newline from a longer one.
            line = lines.readline() if max_line_bytes is None else lines.readline(max_line_bytes + 1)
            if not line:
                return
            number += 1
            if max_line_bytes is not None and len(line) > max_line_bytes and not line.endswith(b"\n"):
                raise LineTooLong(number, max_line_bytes)
            if number == 1:
                line = line.removeprefix(_BOM)
            if line.strip():
                yield number, parse_row(line, number)


def parse_row(line: bytes, number: int) -> dict[str, Any]:
    """One line as a row (a JSON object), or ``JsonlError`` naming ``number``."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise JsonlError(number, f"is not UTF-8 (byte {error.start}); save the file as UTF-8") from None
    too_deep = f"nests objects or lists deeper than {MAX_DEPTH} levels; flatten the row"
    try:
        row = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as duplicate:
        raise JsonlError(
            number, f"has the key {duplicate.key!r} twice in one object; keep one of them (JSON keeps only the last)"
        ) from None
    except RecursionError:  # nested past Python's recursion limit (about 1000 levels)
        raise JsonlError(number, too_deep) from None
    except ValueError as error:  # JSONDecodeError
        raise JsonlError(number, f"is not valid JSON ({error}); write JSON Lines, one object per line") from None
    # Measured after the parse, on valid JSON only: its strings are well formed, so the scan is linear.
    if _deeper_than(line, MAX_DEPTH):
        raise JsonlError(number, too_deep)
    if not isinstance(row, dict):
        raise JsonlError(number, f"must be a JSON object; got {type(row).__name__}")
    return row


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    row = dict(pairs)
    if len(row) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))  # type: ignore[func-returns-value]
    return row


def _deeper_than(line: bytes, limit: int) -> bool:
    """Whether the brackets of ``line`` (outside its strings) nest past ``limit``."""
    if line.count(b"[") + line.count(b"{") <= limit:  # the usual row: too few brackets to nest that deep
        return False
    depth = 0
    for byte in _STRING.sub(b'""', line).translate(None, _NOT_BRACKET):
        depth += 1 if byte in _OPEN else -1
        if depth > limit:
            return True
    return False
