"""Check a YAML text's shape before anything expands it: nesting depth and alias expansion (billion laughs).

``yaml.safe_load`` expands every alias into a full copy, so a few hundred bytes of anchors can ask for
gigabytes. Walking the event stream instead costs time linear in the text and memory linear in the anchors.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

MAX_DIGITS = 64  # a plain integer longer than this is refused before Python spends time converting it


@dataclass(frozen=True)
class YamlShapeError(ValueError):
    """The text is not YAML, nests too deep, or expands to too many nodes."""

    message: str
    line: int | None = None

    def __str__(self) -> str:
        return self.message


def check_yaml_shape(text: str, *, max_depth: int, max_nodes: int) -> None:
    """Raise ``YamlShapeError`` unless ``text`` parses, nests at most ``max_depth`` deep and, with every
    alias expanded, holds at most ``max_nodes`` nodes.

    Example:
        check_yaml_shape(body, max_depth=32, max_nodes=20_000)
    """
    # Each open collection counts the nodes inside it, so an anchor knows its expanded size when it closes.
    open_counts: list[int] = [0]
    open_anchors: list[str | None] = []
    anchor_sizes: dict[str, int] = {}
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                if len(open_anchors) >= max_depth:
                    raise YamlShapeError(f"the spec nests deeper than {max_depth} levels; flatten it", _line(event))
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
                        f"a number of {len(event.value)} digits; no field takes more than {MAX_DIGITS} "
                        "(2**63 - 1 has 19)",
                        _line(event),
                    )
                if event.anchor:
                    anchor_sizes[event.anchor] = 1
                open_counts[-1] += 1
            elif isinstance(event, yaml.AliasEvent):
                open_counts[-1] += anchor_sizes.get(event.anchor, 1)
            if open_counts[-1] > max_nodes or sum(open_counts) > max_nodes:
                raise YamlShapeError(
                    f"the spec expands to more than {max_nodes} YAML nodes once its aliases (*name) are "
                    "expanded; write the values out instead of repeating anchors",
                    _line(event),
                )
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark else None
        where = f" at line {line}, column {mark.column + 1}" if mark else ""
        raise YamlShapeError(f"the spec is not valid YAML: {error.problem or error.context}{where}", line) from None
    except yaml.YAMLError as error:
        raise YamlShapeError(f"the spec is not valid YAML: {error}") from None


def _line(event: yaml.Event) -> int | None:
    return event.start_mark.line + 1 if event.start_mark else None
