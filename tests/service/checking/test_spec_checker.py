"""The spec checker process: a check past its time limit is a 422 and costs the checker its process, a checker
that died is started again, and the API answers for both without storing anything."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.errors import ApiError
from service.checking.checker import SpecCheckerProcess
from service.checking.messages import CheckRequest
from service.settings import Settings
from tests.service.checking.test_one_parse import IdleExecutor
from tests.service.conftest import spec_yaml

YAML = {"content-type": "application/yaml"}
# The hostile spec: its estimate takes tens of milliseconds (bigger models longer), far over 5 ms.
DEEP = spec_yaml(name="deep").replace("num_layers: 2", "num_layers: 200000")


def request(text: str) -> CheckRequest:
    return CheckRequest(text=text, model_roots=(), data_roots=(), max_yaml_depth=32, max_yaml_nodes=20_000)


def test_a_check_past_its_time_limit_is_refused_and_the_checker_replaced(tmp_path: Path) -> None:
    checker = SpecCheckerProcess(timeout_s=30)
    checker.start()
    try:
        assert checker.check(request(spec_yaml())).name == "smoke"
        first = checker.pid
        checker.timeout_s = 0.005
        with pytest.raises(ApiError) as refused:
            checker.check(request(DEEP))
        assert (refused.value.status_code, refused.value.code) == (422, "spec_check_timeout")
        assert refused.value.message.startswith(
            "Checking the spec took longer than 0.005 s (FERRY_SPEC_CHECK_TIMEOUT_S) and was stopped"
        )
        assert checker.pid != first  # the overrunning check was killed with its process
        checker.timeout_s = 30
        assert checker.check(request(spec_yaml(name="after"))).name == "after"

        dead = checker.pid
        os.kill(dead, signal.SIGKILL)  # died between checks (the OOM killer, an operator)
        while psutil.Process(dead).status() != psutil.STATUS_ZOMBIE:  # gone, not yet reaped
            time.sleep(0.01)
        assert checker.check(request(spec_yaml(name="revived"))).name == "revived"
        assert checker.pid != dead
    finally:
        checker.close()


def test_the_api_answers_an_overrun_with_422_and_stores_nothing(tmp_path: Path) -> None:
    checker = SpecCheckerProcess(timeout_s=0.005)
    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None)
    try:
        with TestClient(create_app(settings, executor=IdleExecutor(), spec_checker=checker)) as client:
            checker.start()
            for route in ("/v1/jobs", "/v1/jobs/validate"):
                answer = client.post(route, content=DEEP, headers=YAML)
                assert answer.status_code == 422, answer.text
                assert answer.json()["error"]["code"] == "spec_check_timeout"
            assert client.get("/v1/jobs").json()["data"] == []
        assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())
    finally:
        checker.close()


def _exit_at_once(connection: object, memory_bytes: int | None) -> None:
    sys.exit(3)  # as a checker whose imports fail would


class NeverStarts(SpecCheckerProcess):
    entry_point = staticmethod(_exit_at_once)


def test_a_checker_that_cannot_start_is_a_503_and_readiness_says_why(tmp_path: Path) -> None:
    checker = NeverStarts(start_timeout_s=60)
    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None)
    try:
        with TestClient(create_app(settings, executor=IdleExecutor(), spec_checker=checker)) as client:
            deadline = time.monotonic() + 60
            while client.get("/ready").json()["status"] == "starting" and time.monotonic() < deadline:
                time.sleep(0.05)
            ready = client.get("/ready")
            assert (ready.status_code, ready.json()) == (
                503,
                {
                    "status": "unavailable",
                    "reason": "the spec checker exited while starting (code 3); see the server log",
                },
            )
        deadline = time.monotonic() + 60
        while checker.problem is None and time.monotonic() < deadline:
            assert not checker.ready
            time.sleep(0.05)
        assert checker.problem == "exited while starting (code 3)"
        with pytest.raises(ApiError) as refused:
            checker.check(request(spec_yaml()))  # tries a new checker, which ends the same way
        assert (refused.value.status_code, refused.value.code) == (503, "spec_checker_unavailable")
        assert (
            refused.value.message
            == "The spec checker exited while starting (code 3); see the server log. Try again shortly."
        )
        assert refused.value.headers == {"Retry-After": "10"}
    finally:
        checker.close()
