"""A job spec's YAML text parsed once: its data, the line of every key and the keys it repeats.

One parse serves a whole submission: the service's shape guard watches the parser's events as they pass
(``on_event``), `load_job_spec` validates the data, and every problem found later (preflight, the fit
check) takes its line from the same map instead of parsing the text again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

Lines = dict[tuple[str, ...], int]


@dataclass(frozen=True)
class ParsedSpec:
    """The text as submitted, the data it holds, the 1-based line of each key path, and repeated keys.

    Example:
        >>> parsed = parse_spec_text("name: a\ntraining:\n  steps: 3\n")
        >>> parsed.line_of("training.steps"), parsed.line_of("training.nope")
        (3, 2)
    """

    text: str
    data: Any
    lines: Lines
    duplicates: list[tuple[tuple[str, ...], int]]

    def line_of(self, path: str) -> int | None:
        """The line of the dotted ``path`` (a missing key: its nearest parent's line)."""
        return line_in(path.split("."), self.lines)


class _WatchedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a hook on each event the composer consumes (the shape guard's view)."""

    on_event: Callable[[yaml.Event], None] | None = None

    def get_event(self) -> yaml.Event:
        event = super().get_event()
        if self.on_event is not None:
            self.on_event(event)
        return event


def parse_spec_text(text: str, *, on_event: Callable[[yaml.Event], None] | None = None) -> ParsedSpec:
    """Parse ``text`` once: compose its node graph (aliases stay shared, nothing is expanded), then build the
    data and the line map from it. Raises ``yaml.YAMLError`` for text that is not YAML, and whatever
    ``on_event`` raises to stop the parse (before any alias is expanded)."""
    loader = _WatchedLoader(text)
    loader.on_event = on_event
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    return ParsedSpec(text, data, _key_lines(node), _duplicate_keys(node))


def _key_lines(node: yaml.Node | None, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Map each key path in the YAML document to the 1-based line of its key."""
    lines: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = (*prefix, str(key_node.value))
            lines.setdefault(path, key_node.start_mark.line + 1)
            lines.update(_key_lines(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*prefix, str(index))] = item.start_mark.line + 1
            lines.update(_key_lines(item, (*prefix, str(index))))
    return lines


def _duplicate_keys(node: yaml.Node | None, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], int]]:
    """(path, line) of every key that repeats an earlier key of the same mapping."""
    found: list[tuple[tuple[str, ...], int]] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            path = (*prefix, str(key_node.value))
            if path[-1] in seen:
                found.append((path, key_node.start_mark.line + 1))
            seen.add(path[-1])
            found += _duplicate_keys(value_node, path)
    return found


def line_in(path: list[str] | tuple[str, ...], lines: dict[tuple[str, ...], int]) -> int | None:
    """Line of the deepest key of ``path`` present in the YAML (a missing key points at its parent)."""
    for end in range(len(path), 0, -1):
        if tuple(path[:end]) in lines:
            return lines[tuple(path[:end])]
    return None
