"""Experiment tracking: MLflow and W&B (offline) when their extras are installed; a clear refusal when not."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs import PathRoots, load_job_spec, run_job
from jobs.reporting.tracking import missing_tracking_packages
from jobs.spec.preflight import preflight_problems
from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl


@pytest.fixture
def llm_roots(tmp_path: Path) -> PathRoots:
    models, data = tmp_path / "models", tmp_path / "data"
    save_bpe_tokenizer(models / "tok")
    save_llama(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(12)])
    return PathRoots(model_roots=[models], data_roots=[data])


def spec(roots: PathRoots, **sections: Any) -> Any:
    return load_job_spec(yaml.safe_dump(llm_spec(training={"steps": 2}, **sections)), roots)


def test_a_tracker_whose_package_is_missing_is_refused_at_submit(
    llm_roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("mlflow", "wandb") else real(name, *a)
    )
    job = spec(llm_roots, tracking={"mlflow": {}, "wandb": {"mode": "offline"}})
    assert missing_tracking_packages(job.tracking) == [
        ("tracking.mlflow", "needs the mlflow package: pip install 'ferry[mlflow]'"),
        ("tracking.wandb", "needs the wandb package: pip install 'ferry[wandb]'"),
    ]
    assert [p.path for p in preflight_problems(job)] == ["tracking.mlflow", "tracking.wandb"]


def test_tensorboard_can_be_turned_off(tmp_path: Path, llm_roots: PathRoots) -> None:
    run_job(spec(llm_roots, tracking={"tensorboard": False}), output_dir=tmp_path / "out")
    assert not (tmp_path / "out" / "tensorboard").exists()


def test_mlflow_file_store_gets_the_metrics(tmp_path: Path, llm_roots: PathRoots) -> None:
    mlflow = pytest.importorskip("mlflow")  # the extra ferry[mlflow]; not installed in CI by default
    run_job(spec(llm_roots, tracking={"mlflow": {"experiment": "t"}}, eval={"split": 0.25}), output_dir=tmp_path / "o")
    mlflow.set_tracking_uri((tmp_path / "o" / "mlruns").resolve().as_uri())
    (run,) = mlflow.search_runs(experiment_names=["t"], output_format="list")
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == [1, 2] and "eval_loss" in run.data.metrics


def test_wandb_offline_writes_a_run(tmp_path: Path, llm_roots: PathRoots, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")  # the extra ferry[wandb]; not installed in CI by default
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_job(spec(llm_roots, tracking={"wandb": {"project": "t", "mode": "offline"}}), output_dir=tmp_path / "o")
    assert list((tmp_path / "o" / "wandb").glob("offline-run-*"))
