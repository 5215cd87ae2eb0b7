"""The result of converting an axolotl config: the Ferry spec, its notes, and every key not converted and why.

The spec is written by a YAML serializer (``yaml.safe_dump``), never assembled from strings, and the notes that
travel with it as comments are made single-line first: a key or path holding a newline (or ``\\r``, U+2028,
U+0085, any character ``str.splitlines`` breaks on) cannot start a line of its own. The text is parsed back and
compared with the spec before anyone sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from jobs.convert.axolotl.reader import key_shown

HEADER = (
    "# Converted from an axolotl config (python -m jobs import-axolotl); what was not converted is listed at the end."
)


@dataclass
class AxolotlConversion:
    """The Ferry spec built from an axolotl config.

    Attributes:
        spec: the spec as data (what ``to_yaml`` serializes).
        notes: keys that were converted with a caveat (a Hub id read as a local path, an approximation).
        not_converted: ``(key, why)`` for each key Ferry has no place for; ``datasets[1].type`` for an entry's.
        mapped: the top-level keys whose values are in the spec (or whose value asks for what Ferry does).
    """

    spec: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    not_converted: list[tuple[str, str]] = field(default_factory=list)
    mapped: set[str] = field(default_factory=set)

    @property
    def warnings(self) -> list[str]:
        """One line each: the notes, then the block of ``not converted: KEY because WHY`` lines."""
        lines = [f"note: {note}" for note in self.notes]
        return lines + [f"not converted: {key_shown(key)} because {why}" for key, why in self.not_converted]

    def to_yaml(self) -> str:
        """The spec as YAML, the warnings as one block of comments at its end (stored with the spec).

        Raises:
            ValueError: the text does not read back as the spec (a defect; nothing is printed or stored).
        """
        body = yaml.safe_dump(self.spec, sort_keys=False, allow_unicode=False, width=10_000)
        comments = "".join(f"# {one_line(w)}\n" for w in self.warnings)
        text = f"{HEADER}\n{body}{comments}"
        check_text(text, self.spec)
        return text


def one_line(text: str) -> str:
    """``text`` with every character ``str.splitlines`` breaks on (and other controls) written as an escape."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def check_text(text: str, spec: dict[str, Any]) -> None:
    """Raise unless ``text`` parses back to exactly ``spec`` and every line outside it is a comment."""
    if yaml.safe_load(text) != spec:
        raise ValueError("the converted spec does not read back as written; report this config as a bug")
    body_lines = yaml.safe_dump(spec, sort_keys=False, allow_unicode=False, width=10_000).splitlines()
    extra = [line for line in text.splitlines() if not line.startswith("#")]
    if extra != body_lines:
        raise ValueError("the converted spec's comments hold a line that is not a comment; report this config as a bug")
