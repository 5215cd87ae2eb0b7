"""The dashboard reads exactly what the API returns: every field it reads is in /openapi.json.

Each dashboard function that takes an API object names its schema in a JSDoc ``@param {Schema} name``; this
test reads every ``name.a?.b`` chain in that function and resolves it against the schema, so a field the
dashboard reads but the API does not declare (a guessed spelling, a renamed key) fails here, in CI,
without a browser.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from service.app import create_app
from service.dashboard.mount import STATIC_DIR
from service.settings import Settings

DOC_AND_FUNCTION = re.compile(
    r"/\*\*((?:(?!\*/).)*?)\*/\s*(?:export\s+)?(?:async\s+)?function\s+(\w+)\s*\([^)]*\)\s*\{", re.DOTALL
)
PARAM = re.compile(r"@param\s+\{(\w+)\}\s+(\w+)")
ARRAY_MEMBERS = {"map", "filter", "some", "every", "find", "flatMap", "forEach", "includes", "length", "slice"}
STRING_MEMBERS = {"length", "slice", "split", "startsWith", "endsWith", "includes", "toLowerCase", "trim"}
# Functions that must keep naming their schema (they are the dashboard's readers of API objects).
REQUIRED = {
    ("model.js", "normalizeJob"): "JobPublic",
    ("model.js", "flattenStep"): "MetricPoint",
    ("model.js", "unwrapEvent"): "EventPublic",
    ("model.js", "problemsOf"): "ErrorBody",
    ("model.js", "estimateOf"): "ValidationPublic",
    ("workers.js", "workerCard"): "WorkerPublic",
    ("checkpoints.js", "fileRow"): "CheckpointFile",
    ("event-log.js", "describeFailed"): "FailedEvent",
}


@pytest.fixture(scope="module")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("data"), _env_file=None)
    return create_app(settings).openapi()["components"]["schemas"]


def annotated_reads(source: str) -> list[tuple[str, str, str, list[str]]]:
    """(function, schema, variable, path) for every member chain read from an annotated parameter."""
    reads = []
    for match in DOC_AND_FUNCTION.finditer(source):
        body = _body(source, match.end() - 1)
        for schema, variable in PARAM.findall(match.group(1)):
            for chain in re.findall(rf"(?<![\w.$]){variable}((?:\??\.[A-Za-z_$][\w$]*)+)", body):
                reads.append((match.group(2), schema, variable, re.split(r"\??\.", chain)[1:]))
    return reads


def _body(source: str, opening: int) -> str:
    depth = 0
    for index in range(opening, len(source)):
        depth += {"{": 1, "}": -1}.get(source[index], 0)
        if depth == 0:
            return source[opening : index + 1]
    raise AssertionError("unbalanced braces")


def missing_field(schemas: dict[str, Any], schema: str, path: list[str]) -> str | None:
    """The first part of ``path`` the schema does not declare (None when all of it resolves)."""
    current = [schemas[schema]]
    for part in path:
        options = _alternatives(schemas, current)
        if any(o.get("type") == "array" for o in options) and part in ARRAY_MEMBERS:
            return None
        if any(o.get("type") == "string" for o in options) and part in STRING_MEMBERS:
            return None
        if any("properties" not in o for o in options if o.get("type") in (None, "object")):
            return None  # a free-form object (dict[str, Any], the spec): any key may be read
        found = [o["properties"][part] for o in options if part in o.get("properties", {})]
        if not found:
            return part
        current = found
    return None


def _alternatives(schemas: dict[str, Any], nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for node in nodes:
        if "$ref" in node:
            out += _alternatives(schemas, [schemas[node["$ref"].rsplit("/", 1)[1]]])
        elif any(key in node for key in ("anyOf", "oneOf", "allOf")):
            out += _alternatives(schemas, [n for key in ("anyOf", "oneOf", "allOf") for n in node.get(key, [])])
        elif node.get("type") != "null":
            out.append(node)
    return out


def dashboard_sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(STATIC_DIR.rglob("*.js"))}


def test_every_field_the_dashboard_reads_is_in_the_openapi_schema(schemas: dict[str, Any]) -> None:
    problems, checked = [], 0
    for path, source in dashboard_sources().items():
        for function, schema, variable, chain in annotated_reads(source):
            checked += 1
            if schema not in schemas:
                problems.append(f"{path.name} {function}: @param {{{schema}}} is not a schema of /openapi.json")
                continue
            missing = missing_field(schemas, schema, chain)
            if missing is not None:
                problems.append(f"{path.name} {function}: {variable}.{'.'.join(chain)}: {schema} has no '{missing}'")
    assert not problems, "\n".join(problems)
    assert checked > 80  # the readers are annotated (a regex that matched nothing would pass vacuously)


def test_the_readers_of_api_objects_name_their_schema() -> None:
    annotated = {
        (path.name, function): schema
        for path, source in dashboard_sources().items()
        for function, schema, _, _ in annotated_reads(source)
    }
    assert {key: annotated.get(key) for key in REQUIRED} == REQUIRED


def test_no_guessed_spellings_and_no_copy_of_the_servers_tables() -> None:
    for path, source in dashboard_sources().items():
        assert "pick(" not in source, f"{path.name} guesses field names with pick()"
        assert not re.search(r"\bACTIONS\s*=", source), f"{path.name} copies the server's table of actions"


def test_a_field_the_schema_lacks_is_caught(schemas: dict[str, Any]) -> None:
    source = """
    /** @param {JobPublic} raw */
    function reader(raw) { return [raw.spec_text, raw.spec_yaml, raw.progress?.eta_seconds, raw.error?.code]; }
    """
    found = {tuple(chain): missing_field(schemas, schema, chain) for _, schema, _, chain in annotated_reads(source)}
    assert found == {
        ("spec_text",): None,
        ("spec_yaml",): "spec_yaml",
        ("progress", "eta_seconds"): "eta_seconds",
        ("error", "code"): None,
    }
