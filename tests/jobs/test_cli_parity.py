"""python -m jobs validate and run check what the service checks at submit (a GPU for device: cuda, the host
memory the estimate needs) with its messages, and default to its model and data roots: a shipped config runs
from the command line as its header says."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from jobs.cli import main
from tests.jobs.helpers import TOY, merged

REPO = Path(__file__).parents[2]
NO_GPU = (
    "device: cuda, but no CUDA device is available here; set device: cpu or auto, or run it on a machine with a GPU"
)


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_shipped_config_validates_from_any_directory_with_the_default_roots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # its data, configs/data/tiny_corpus.txt, is a default data root
    assert main(["validate", str(REPO / "configs" / "transformer_lm_lora_cpu.yaml")]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("ok: transformer-lm-lora-cpu")


def test_the_service_default_model_root_is_a_default_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ferry-data" / "models" / "tiny").mkdir(parents=True)  # where the service looks by default
    spec = write(tmp_path / "ferry-data", merged(TOY, model={"kind": "hf_causal_lm", "path": "tiny"}))
    main(["validate", str(spec)])  # an empty directory: refused, but found
    error = capsys.readouterr().err
    assert "'tiny' does not exist" not in error and "outside the allowed model roots" not in error


@pytest.mark.parametrize("command", ["validate", "run"])
def test_device_cuda_without_a_gpu_is_refused_as_the_service_refuses_it(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = write(tmp_path, merged(TOY, device="cuda"))
    assert main([command, str(spec), *(["--output", str(tmp_path / "out")] if command == "run" else [])]) == 2
    assert capsys.readouterr().err == f"invalid job spec (1 problem(s)):\n  - device (line 2): {NO_GPU}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_job_beyond_the_hosts_memory_is_refused(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    memory = namedtuple("memory", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(1024, 1024))
    spec = write(tmp_path, TOY)  # device: cpu, a few MB
    output = ["--output", str(tmp_path / "out")] if command == "run" else []
    assert main([command, str(spec), *output]) == 2
    error = capsys.readouterr().err
    assert "  - model (line 3): the job needs an estimated " in error
    assert error.rstrip().endswith("but this machine has 1.0 KiB")
    assert main([command, str(spec), "--no-fit-check", *output]) == 0
