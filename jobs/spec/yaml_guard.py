"""Check a YAML text's shape before anything expands it: nesting depth and alias expansion (billion laughs).

``yaml.safe_load`` expands every alias into a full copy, so a few hundred bytes of anchors can ask for
gigabytes. Walking the event stream instead costs time linear in the text and memory linear in the anchors.
Every entry point that reads YAML from a user goes through here: `load_job_spec` (the CLI's ``validate``,
``run``, ``estimate``), the axolotl importer, and the service (which passes its own limits, the settings'
``FERRY_MAX_YAML_DEPTH`` and ``FERRY_MAX_YAML_NODES``).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

MAX_DIGITS = 64  # a plain integer longer than this is refused before Python spends time converting it
MAX_DEPTH = 32  # the default nesting limit; a job spec nests five levels deep
MAX_NODES = 20_000  # the default node limit once aliases are expanded; a large spec holds a few hundred


@dataclass(frozen=True)
class YamlShapeError(ValueError):
    """The text is not YAML, nests too deep, or expands to too many nodes."""

    message: str
    line: int | None = None

    def __str__(self) -> str:
        return self.message


def check_yaml_shape(text: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """Raise ``YamlShapeError`` unless ``text`` parses, nests at most ``max_depth`` deep and, with every
    alias expanded, holds at most ``max_nodes`` nodes.

    Example:
        check_yaml_shape(body, max_depth=32, max_nodes=20_000)
    """
    guard = ShapeGuard(max_depth=max_depth, max_nodes=max_nodes)
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            guard.see(event)
    except yaml.YAMLError as error:
        raise shape_error(error) from None


class ShapeGuard:
    """The shape check, one parser event at a time: it can watch the one parse that also builds the spec
    (``jobs.parse_spec_text(text, on_event=guard.see)``), and raises before an oversized alias is expanded."""

    def __init__(self, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
        self.max_depth, self.max_nodes = max_depth, max_nodes
        # Each open collection counts the nodes inside it, so an anchor knows its expanded size when it closes.
        self._open_counts: list[int] = [0]
        self._open_anchors: list[str | None] = []
        self._anchor_sizes: dict[str, int] = {}

    def see(self, event: yaml.Event) -> None:
        """Account for one event; ``YamlShapeError`` when the text is too deep or expands too far."""
        open_counts, open_anchors, anchor_sizes = self._open_counts, self._open_anchors, self._anchor_sizes
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(open_anchors) >= self.max_depth:
                raise YamlShapeError(f"the spec nests deeper than {self.max_depth} levels; flatten it", _line(event))
            open_counts.append(1)
            open_anchors.append(event.anchor)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            size, anchor = open_counts.pop(), open_anchors.pop()
            if anchor:
                anchor_sizes[anchor] = size
            open_counts[-1] += size
        elif isinstance(event, yaml.ScalarEvent):
            if event.style is None and len(event.value) > MAX_DIGITS and event.value.lstrip("+-").isdigit():
                raise YamlShapeError(
                    f"a number of {len(event.value)} digits; no field takes more than {MAX_DIGITS} (2**63 - 1 has 19)",
                    _line(event),
                )
            if event.anchor:
                anchor_sizes[event.anchor] = 1
            open_counts[-1] += 1
        elif isinstance(event, yaml.AliasEvent):
            open_counts[-1] += anchor_sizes.get(event.anchor, 1)
        if open_counts[-1] > self.max_nodes or sum(open_counts) > self.max_nodes:
            raise YamlShapeError(
                f"the spec expands to more than {self.max_nodes} YAML nodes once its aliases (*name) are "
                "expanded; write the values out instead of repeating anchors",
                _line(event),
            )


def shape_error(error: yaml.YAMLError) -> YamlShapeError:
    """A YAML syntax error as the problem the API reports (with its line and column)."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark else None
        where = f" at line {line}, column {mark.column + 1}" if mark else ""
        return YamlShapeError(f"the spec is not valid YAML: {error.problem or error.context}{where}", line)
    return YamlShapeError(f"the spec is not valid YAML: {error}")


def _line(event: yaml.Event) -> int | None:
    return event.start_mark.line + 1 if event.start_mark else None
