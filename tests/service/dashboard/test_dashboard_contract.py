"""The dashboard reads exactly what the API returns: every field it reads is in /openapi.json.

Each dashboard function that takes an API object names its schema in a JSDoc ``@param {Schema} name``; this
test reads every ``name.a?.b`` chain in that function and resolves it against the schema, so a field the
dashboard reads but the API does not declare (a guessed spelling, a renamed key) fails here, in CI,
without a browser. Every answer of ``api()`` must go straight into such a reader (``reader(await api(...))``
or ``api(...).then(reader)``), so no page can keep an answer in a variable and read it unchecked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from service.api.app import create_app
from service.dashboard.mount import STATIC_DIR
from service.settings import Settings

DOC_AND_FUNCTION = re.compile(
    r"/\*\*((?:(?!\*/).)*?)\*/\s*(?:export\s+)?(?:async\s+)?function\s+(\w+)\s*\([^)]*\)\s*\{", re.DOTALL
)
PARAM = re.compile(r"@param\s+\{(\w+)\}\s+(\w+)")
ARRAY_MEMBERS = {"map", "filter", "some", "every", "find", "flatMap", "forEach", "includes", "length", "slice"}
CALLBACK = re.compile(r"\(\s*\(?\s*(\w+)\s*\)?\s*=>")  # `(x) =>` right after `.map` and the like
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
    ("model.js", "metricsPage"): "MetricsPublic",
    ("model.js", "eventsPage"): "EventsPublic",
    ("model.js", "jobsPage"): "JobsPublic",
    ("model.js", "evalPoint"): "EvalPoint",
    ("model.js", "samplesOf"): "SamplesPublic",
    ("model.js", "normalizeSample"): "SamplePoint",
    ("model.js", "mergedArchive"): "MergedPublic",
    ("model.js", "checkpointExports"): "CheckpointPublic",
    ("model.js", "ggufExportable"): "CheckpointPublic",
    ("model.js", "ggufFile"): "GgufPublic",
}
# `reader(await api(...))` or `api(...).then(reader)`: what the service answered goes straight to a reader.
AWAITED_ANSWER = re.compile(r"(\w+)\(await api\($")


@pytest.fixture(scope="module")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("data"), _env_file=None)
    return create_app(settings).openapi()["components"]["schemas"]


def annotated_reads(source: str) -> list[tuple[str, str, str, list[str]]]:
    """(function, schema, variable, path) for every member chain read from an annotated parameter.

    The element of an array read through a callback (``body.data.map((job) => job.name)``) is followed
    too: its path goes through ``[]``, the array's items.
    """
    reads = []
    for match in DOC_AND_FUNCTION.finditer(source):
        body = _balanced(source, match.end() - 1, "{}")
        for schema, variable in PARAM.findall(match.group(1)):
            reads += [(match.group(2), schema, variable, path) for path in _chains(body, variable)]
    return reads


def _chains(code: str, variable: str) -> list[list[str]]:
    chains = []
    for found in re.finditer(rf"(?<![\w.$]){variable}((?:\??\.[A-Za-z_$][\w$]*)+)", code):
        path = re.split(r"\??\.", found.group(1))[1:]
        chains.append(path)
        callback = CALLBACK.match(code, found.end())
        if path[-1] in ARRAY_MEMBERS and callback:
            arrow = _balanced(code, found.end(), "()")
            chains += [[*path[:-1], "[]", *inner] for inner in _chains(arrow, callback.group(1))]
    return chains


def _balanced(source: str, opening: int, pair: str) -> str:
    depth = 0
    for index in range(opening, len(source)):
        depth += {pair[0]: 1, pair[1]: -1}.get(source[index], 0)
        if depth == 0:
            return source[opening : index + 1]
    raise AssertionError(f"unbalanced {pair}")


def missing_field(schemas: dict[str, Any], schema: str, path: list[str]) -> str | None:
    """The first part of ``path`` the schema does not declare (None when all of it resolves)."""
    current = [schemas[schema]]
    for part in path:
        options = _alternatives(schemas, current)
        if part == "[]":  # the elements of an array read through a callback
            current = [o["items"] for o in options if o.get("type") == "array"]
            if not current:
                return part
            continue
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


def test_every_answer_of_the_api_goes_straight_to_an_annotated_reader() -> None:
    """A page that kept an answer in a variable could read any field of it unchecked; none does."""
    sources = dashboard_sources()
    readers = {function for source in sources.values() for function, *_ in annotated_reads(source)}
    unread, calls = [], 0
    for path, source in sources.items():
        for call in re.finditer(r"(?<![\w.])api\(", source):
            if source[: call.start()].endswith("function "):
                continue  # api.js's definition
            calls += 1
            before = AWAITED_ANSWER.search(source[max(0, call.start() - 60) : call.end()])
            after = re.match(
                r"\.then\((\w+)\)", source[call.start() + len(_balanced(source, call.end() - 1, "()")) + 3 :]
            )
            found = before or after
            reader = found.group(1) if found else None
            if reader not in readers:
                line = source.count("\n", 0, call.start()) + 1
                unread.append(
                    f"{path.name}:{line}: the answer of api() goes to {reader or 'a variable'}, not an annotated reader"
                )
    assert not unread, "\n".join(unread)
    assert calls >= 10


def test_a_field_read_through_a_callback_is_checked(schemas: dict[str, Any]) -> None:
    source = """
    /** @param {JobsPublic} body */
    function names(body) { return new Map(body.data.map((job) => [job.id, job.nmae])); }
    """
    found = {tuple(chain): missing_field(schemas, schema, chain) for _, schema, _, chain in annotated_reads(source)}
    assert found == {("data", "map"): None, ("data", "[]", "id"): None, ("data", "[]", "nmae"): "nmae"}
