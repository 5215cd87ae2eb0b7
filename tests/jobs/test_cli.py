"""python -m jobs: run, validate, estimate, schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobs.cli import main
from tests.jobs.helpers import TOY

REPO = Path(__file__).parents[2]


@pytest.fixture
def toy_file(tmp_path: Path) -> Path:
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(TOY))
    return path


def test_validate_ok_and_bad(toy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(toy_file)]) == 0
    assert capsys.readouterr().out.strip() == "ok: toy (10 steps, model toy_mlp, device cpu)"
    bad = tmp_path / "bad.yaml"
    bad.write_text(toy_file.read_text().replace("learning_rate", "learning_rat"))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "training.learning_rat (line" in err and "did you mean 'learning_rate'?" in err


def test_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_estimate_and_schema(toy_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", str(toy_file)]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["peak_device_bytes"] > 0 and estimate["pinned_host_bytes"] == 0
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "JobSpec"


def test_run_resumes_into_the_output_directory(
    toy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["run", str(toy_file), "--output", str(out)]) == 0
    assert f"succeeded at step 10; checkpoint: {out / 'checkpoints' / 'step-00000010'}" in capsys.readouterr().out
    assert main(["run", str(toy_file), "--output", str(out)]) == 0  # resumes at the end: nothing to do
    assert "succeeded at step 10" in capsys.readouterr().out


def test_python_dash_m_jobs_runs_the_smoke_config(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "jobs", "run", "configs/cpu_smoke.yaml", "--output", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "succeeded at step 30" in result.stdout
    assert "30/30" in result.stderr  # the progress bar
