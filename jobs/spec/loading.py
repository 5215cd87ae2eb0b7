"""The one place YAML becomes a `JobSpec`, with every problem located (path, line) and typos suggested.

Each section checks its own fields (pydantic); the rules across sections (rules.py, and each model family's
own) run here over the built spec, as torchtune validates a built config outside its classes, and their
problems are reported together with any duplicate key or refused number.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from jobs.errors import JobSpecError, SpecProblem
from jobs.paths import PathRoots
from jobs.spec.job import JobSpec
from jobs.spec.rules import cross_section_problems
from jobs.spec.text import ParsedSpec, line_in, parse_spec_text
from jobs.spec.values import (
    PATTERN_RULES,
    SYNONYMS,
    bad_numbers,
    bad_strings,
    flatten_annotation,
    foreign_key_hint,
    list_items,
    other_tools_config,
)
from jobs.spec.wording import ferry_message
from jobs.spec.yaml_guard import ShapeGuard, YamlShapeError

Loc = tuple[str | int, ...]


def load_job_spec(text: str | ParsedSpec, roots: PathRoots | None = None) -> JobSpec:
    """Parse and validate a YAML job spec.

    Args:
        text: The YAML document, or the result of parsing it once (`parse_spec_text`), which is not parsed again.
        roots: Directories model and data paths must stay inside; default: the current directory.

    Returns:
        The validated, immutable spec (paths resolved to absolute ones).

    Raises:
        JobSpecError: With every problem found: its dotted path, YAML line and, for typos, the closest key.

    Example:
        >>> spec = load_job_spec(open("configs/cpu_smoke.yaml").read())
        >>> spec.training.steps
        30
    """
    try:
        # Text is parsed under the shape guard's default limits (an alias bomb stops before it expands); a
        # caller with limits of its own (the service) parses with them and passes the result.
        parsed = text if isinstance(text, ParsedSpec) else parse_spec_text(text, on_event=ShapeGuard().see)
    except YamlShapeError as exc:
        raise JobSpecError([SpecProblem("", exc.message, exc.line)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise JobSpecError([SpecProblem("", f"not valid YAML: {exc}", mark.line + 1 if mark else None)]) from exc
    except RecursionError:
        raise JobSpecError([SpecProblem("", "nests too deep to read; flatten it")]) from None
    except ValueError as exc:  # Python refuses to read an integer of over 4300 digits
        raise JobSpecError([SpecProblem("", f"holds a number no field can take ({exc})")]) from None
    data, lines = parsed.data, parsed.lines
    if not isinstance(data, dict):
        raise JobSpecError([SpecProblem("", f"a job spec is a YAML mapping; got {type(data).__name__}", 1)])
    foreign = other_tools_config(data)
    if foreign is not None:  # forty unknown keys would hide the one thing to do
        raise JobSpecError([SpecProblem(foreign[0], foreign[1], line_in([foreign[0]], lines))])
    # Checked before pydantic, whose messages echo the input: a lone surrogate in an answer cannot be encoded.
    unreadable = [SpecProblem(".".join(path), message, line_in(path, lines)) for path, message in bad_strings(data)]
    if unreadable:
        raise JobSpecError(unreadable)
    # YAML keeps the last of two equal keys without a word; a spec that says a thing twice is refused.
    duplicates = [
        SpecProblem(".".join(path), f"duplicate key (first on line {lines[path]})", line)
        for path, line in parsed.duplicates
    ]
    # Pydantic's lax mode takes `true` for 1 and any integer for an int field; these are refused beside it.
    numbers = [
        SpecProblem(".".join(path), message, line_in(path, lines)) for path, message in bad_numbers(data, JobSpec)
    ]
    flagged = {p.path for p in numbers}
    try:
        spec = JobSpec.model_validate(data, context={"roots": roots or PathRoots.here()})
    except ValidationError as exc:
        problems = duplicates + numbers + [p for p in _problems(exc, data, lines) if p.path not in flagged]
        raise JobSpecError(sorted(problems, key=lambda p: (p.line or 0, p.path))) from None
    # The sections are valid: now the rules across them, over the built spec.
    rules = [p for p in _rule_problems(spec, lines) if p.path not in flagged]
    if duplicates or numbers or rules:
        raise JobSpecError(sorted(duplicates + numbers + rules, key=lambda p: (p.line or 0, p.path)))
    return spec


def _rule_problems(spec: JobSpec, lines: dict[tuple[str, ...], int]) -> list[SpecProblem]:
    """The cross-section rules' problems, each at its path's line. A rule that raises ``ValueError`` is
    reported as a problem of the whole spec."""
    try:
        found = cross_section_problems(spec)
    except ValueError as exc:
        return [SpecProblem("", str(exc), line_in([], lines))]
    return [SpecProblem(path, message, line_in(path.split("."), lines)) for path, message in found]


def _problems(exc: ValidationError, data: dict, lines: dict[tuple[str, ...], int]) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    for error in exc.errors():
        path = _data_path(error["loc"], data)
        if error["type"] == "spec_rules":
            for relative, message in error["ctx"]["problems"]:
                rule_path = [*path, *relative.split(".")]
                problems.append(SpecProblem(".".join(rule_path), message, line_in(rule_path, lines)))
        elif error["type"] == "extra_forbidden":
            valid = _valid_keys(error["loc"][:-1])
            suggestion = foreign_key_hint(path) or _closest(str(path[-1]), valid)
            problems.append(
                SpecProblem(
                    ".".join(path), f"unknown key (valid keys: {', '.join(valid)})", line_in(path, lines), suggestion
                )
            )
        elif error["type"] == "union_tag_invalid":
            expected = [t.strip(" '") for t in error["ctx"]["expected_tags"].split(",")]
            tag = str(error["ctx"]["tag"])
            key = str(error["ctx"].get("discriminator", "'kind'")).strip("'")  # kind (models, data), type (graders)
            message = f"unknown {key} '{tag}' (one of: {', '.join(expected)})"
            problems.append(
                SpecProblem(".".join((*path, key)), message, line_in((*path, key), lines), _closest(tag, expected))
            )
        elif error["type"] == "literal_error":
            expected = [t.strip(" '") for t in error["ctx"]["expected"].replace(" or ", ", ").split(",")]
            given = str(error["input"])
            suggestion = SYNONYMS.get(given.lower()) if SYNONYMS.get(given.lower()) in expected else None
            problems.append(
                SpecProblem(
                    ".".join(path),
                    f"must be one of {', '.join(expected)}; got {given!r}",
                    line_in(path, lines),
                    suggestion or _closest(given, expected),
                )
            )
        elif error["type"] == "string_pattern_mismatch" and error["ctx"]["pattern"] in PATTERN_RULES:
            rule = PATTERN_RULES[error["ctx"]["pattern"]]
            problems.append(SpecProblem(".".join(path), f"{rule}; got {error['input']!r}", line_in(path, lines)))
        else:
            problems.append(SpecProblem(".".join(path), ferry_message(error), line_in(path, lines)))
    return problems


def _data_path(loc: Loc, data: Any) -> list[str]:
    """Pydantic's error location minus the union tags it inserts (``model.toy_mlp.x`` → ``model.x``)."""
    path, node = [], data
    for part in loc:
        if isinstance(node, dict) and part not in node and part in (node.get("kind"), node.get("type")):
            continue  # a discriminated-union tag (model kinds, grader types), not a key
        path.append(str(part))
        node = (
            node.get(part)
            if isinstance(node, dict)
            else (node[part] if isinstance(node, list) and isinstance(part, int) and part < len(node) else None)
        )
    return path


def _valid_keys(loc: Loc) -> list[str]:
    """Field names of the spec section at ``loc`` (pydantic location, union tags included)."""
    model: type[BaseModel] = JobSpec
    parts = list(loc)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return []
        annotation = field.annotation
        if parts and isinstance(parts[0], int):  # an item of a list of sections (data.mix.0)
            parts.pop(0)
            annotation = list_items(annotation)
        candidates = [t for t in flatten_annotation(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        if len(candidates) > 1 and parts:  # discriminated union: the next location part is the tag
            tag = parts.pop(0)
            key = "kind" if "kind" in candidates[0].model_fields else "type"  # grader unions are tagged by type
            candidates = [c for c in candidates if typing.get_args(c.model_fields[key].annotation)[:1] == (tag,)]
        if not candidates:
            return []
        model = candidates[0]
    return list(model.model_fields)


def _closest(word: str, candidates: list[str]) -> str | None:
    # Compared case-folded: a value that differs only in case ("adamW") is that value, not a near one ("adam").
    folded = {candidate.casefold(): candidate for candidate in candidates}
    if word.casefold() in folded:
        return folded[word.casefold()]
    matches = difflib.get_close_matches(word.casefold(), list(folded), n=1, cutoff=0.6)
    return folded[matches[0]] if matches else None


def job_spec_schema() -> dict[str, Any]:
    """The JSON Schema of a job spec (``python -m jobs schema``)."""
    return JobSpec.model_json_schema()


def line_of(text: str, path: str) -> int | None:
    """The YAML line of the dotted ``path`` in ``text`` (a missing key: its nearest parent's line). With the
    text already parsed, ask its `ParsedSpec.line_of` instead."""
    try:
        return parse_spec_text(text).line_of(path)
    except (yaml.YAMLError, RecursionError, ValueError):
        return None
