"""From a request body to a checked ``JobSpec``: content type, shape limits, then ``jobs.load_job_spec``."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import yaml

from jobs import JobSpec, JobSpecError, PathRoots, load_job_spec
from jobs.preflight import preflight_problems
from jobs.spec_text import ParsedSpec, parse_spec_text

from .errors import ApiError
from .settings import Settings
from .yaml_guard import ShapeGuard, YamlShapeError, shape_error

YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "text/plain"})
JSON_TYPES = frozenset({"application/json"})


def spec_text_from_body(body: bytes, content_type: str | None) -> str:
    """The spec as text; JSON is accepted as is because JSON is YAML."""
    media_type = (content_type or "application/yaml").split(";")[0].strip().lower()
    if media_type not in YAML_TYPES | JSON_TYPES:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type {media_type!r} is not accepted; send the spec as application/yaml "
            "(or text/yaml) or as application/json.",
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(
            400, "invalid_encoding", f"The body is not UTF-8 (byte {error.start}); save the spec as UTF-8."
        ) from None
    if not text.strip():
        raise _spec_error(
            [{"path": "", "message": "the body is empty; send a job spec", "line": None, "suggestion": None}]
        )
    if media_type in JSON_TYPES:
        _check_json(text)
    return text


def load_checked_spec(text: str, settings: Settings) -> tuple[JobSpec, ParsedSpec]:
    """Parse the text once, its shape checked as the parser goes (before any alias is expanded), then let
    ``jobs`` check every field. Returns the spec and the parsed text, whose line map later problems use."""
    guard = ShapeGuard(max_depth=settings.max_yaml_depth, max_nodes=settings.max_yaml_nodes)
    roots = PathRoots(model_roots=settings.effective_model_roots, data_roots=settings.effective_data_roots)
    try:
        parsed = parse_spec_text(text, on_event=guard.see)
    except YamlShapeError as error:
        raise _spec_error([_whole_text(error)]) from None
    except yaml.YAMLError as error:
        raise _spec_error([_whole_text(shape_error(error))]) from None
    except (RecursionError, ValueError):
        parsed = None  # load_job_spec names these (an unreadable number, nesting Python cannot follow)
    try:
        spec = load_job_spec(parsed if parsed is not None else text, roots=roots)
    except JobSpecError as error:
        raise _spec_error([asdict(p) for p in error.problems]) from None
    assert parsed is not None  # the text that failed to parse above failed in load_job_spec too
    # The files the spec names: the data's first rows (format, fields, chat template), LoRA targets.
    problems = preflight_problems(spec)
    if problems:
        raise _spec_error([{**asdict(p), "line": p.line or parsed.line_of(p.path)} for p in problems])
    return spec, parsed


def _whole_text(error: YamlShapeError) -> dict[str, Any]:
    return {"path": "", "message": error.message, "line": error.line, "suggestion": None}


def _check_json(text: str) -> None:
    try:
        json.loads(text)
    except RecursionError:
        raise _spec_error(
            [{"path": "", "message": "the JSON body nests too deep; flatten it", "line": None, "suggestion": None}]
        ) from None
    except json.JSONDecodeError as error:
        raise _spec_error(
            [
                {
                    "path": "",
                    "message": f"the body is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}",
                    "line": error.lineno,
                    "suggestion": None,
                }
            ]
        ) from None
    except ValueError as error:  # an integer of over 4300 digits
        raise _spec_error(
            [
                {
                    "path": "",
                    "message": f"the JSON body holds a number no field can take ({error})",
                    "line": None,
                    "suggestion": None,
                }
            ]
        ) from None


def _spec_error(problems: list[dict[str, Any]]) -> ApiError:
    listed = "; ".join(_describe(p) for p in problems)
    noun = "problem" if len(problems) == 1 else "problems"
    return ApiError(422, "invalid_spec", f"The job spec has {len(problems)} {noun}: {listed}", problems=problems)


def _describe(problem: dict[str, Any]) -> str:
    where = problem["path"] or "spec"
    if problem.get("line") is not None:
        where += f" (line {problem['line']})"
    hint = f"; did you mean '{problem['suggestion']}'?" if problem.get("suggestion") else ""
    return f"{where}: {problem['message']}{hint}"
