"""A submission's YAML is parsed once: the shape guard, the spec, and every problem's line share one parse."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.settings import Settings

SPEC = """\
name: once
model: {kind: toy_mlp, hidden_size: 16, num_layers: 2}
data: {kind: synthetic_regression}
training: {steps: 3}
device: cuda
"""


class IdleExecutor:
    """Starts nothing: the test is about what happens before a job runs."""

    def launch(self, request: object) -> object:
        raise AssertionError("nothing should be launched")

    def keep_warm(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stop_orphan(self, pid: int | None, started_at: float | None, *, grace_s: float) -> None:
        pass


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """One entry per YAML parse started (every PyYAML loader and yaml.parse build a Parser)."""
    started: list[str] = []
    original = yaml.parser.Parser.__init__

    def counting(self: yaml.parser.Parser) -> None:
        started.append(type(self).__name__)
        original(self)

    monkeypatch.setattr(yaml.parser.Parser, "__init__", counting)
    return started


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/jobs/validate"])
def test_a_submission_is_parsed_once(tmp_path: Path, parses: list[str], route: str) -> None:
    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None)
    # The check runs in this process, so the parses it makes are counted here.
    with TestClient(create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())) as client:
        parses.clear()
        # device: cuda on a CPU-only service is refused after the spec loaded: that problem needs its line.
        answer = client.post(route, content=SPEC, headers={"Content-Type": "application/yaml"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["problems"][0]["line"] == 5
    assert len(parses) == 1, parses
