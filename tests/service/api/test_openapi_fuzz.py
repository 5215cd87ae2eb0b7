"""A bounded schemathesis run over the service's OpenAPI: whatever it generates, no answer is a 500.

Each operation gets a dozen generated requests, valid and invalid by the schema (a few hundred in all, well
under two minutes), against a real server with its own data directory, authenticated so that they reach the
handlers. Half the job routes are aimed at a real finished job with checkpoints, so that cursors, limits,
``Last-Event-ID`` and checkpoint names are fuzzed past the 404 of an unknown id.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra: pip install -e '.[dev]'")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from tests.service.conftest import TOKEN, Server, spec_yaml, submit, wait_status  # noqa: E402

EXAMPLES_PER_OPERATION = 12
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    root: Path = tmp_path_factory.mktemp("fuzz")
    (root / "datasets").mkdir()
    server = Server(root / "data", {"FERRY_API_TOKEN": TOKEN, "FERRY_DATA_ROOTS": str(root / "datasets")})
    server.start()
    try:
        with server.client() as client:
            job = submit(client, spec_yaml(name="fuzzed", steps=2, every=1))
            wait_status(client, job["id"], "succeeded")
        yield server, job["id"]
    finally:
        server.stop()


def test_no_request_gets_a_server_error(fuzzed_server: tuple[Server, str]) -> None:
    server, job_id = fuzzed_server
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 15
    failures: list[str] = []
    for operation in operations:
        strategies = [operation.as_strategy(mode) for mode in schemathesis.GenerationMode]
        if "{job_id}" in operation.path and operation.method.upper() != "DELETE":
            strategies += [operation.as_strategy(path_parameters={"job_id": job_id})]
        # One function per operation, with hypothesis directly: schemathesis' pytest plugin needs its own pytest.

        @given(case=st.one_of(strategies))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def call(case) -> None:  # type: ignore[no-untyped-def]
            case.call_and_validate(headers=AUTH, checks=[not_a_server_error], timeout=20)

        try:
            call()
        except Exception as error:  # every operation is tried; all failures are reported together
            failures.append(f"{operation.label}: {error}")
    assert not failures, "\n\n".join(failures)
