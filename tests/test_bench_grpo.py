"""bench/grpo_bench.py's jobs are valid grpo specs at both scales, and its table says what a row could not run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from bench import grpo_bench
from jobs import PathRoots, load_job_spec


def arguments(out: Path, scale: str) -> argparse.Namespace:
    return argparse.Namespace(
        out=out,
        steps=4,
        prompts=2,
        generations=8,
        new_tokens=256,
        limit="24GiB",
        scale=scale,
        rows="resident",
        compile=False,
    )


@pytest.mark.parametrize("scale", ["full", "tiny"])
def test_every_ferry_row_is_a_grpo_job_that_loads(tmp_path: Path, scale: str) -> None:
    args = arguments(tmp_path, scale)
    grpo_bench.write_data(tmp_path, args.prompts)
    roots = PathRoots(model_roots=[tmp_path / "models"], data_roots=[tmp_path / "datasets"])
    for row in ("resident", "limit", "32b"):
        model_dir, shape = grpo_bench.SHAPES[row]
        grpo_bench.write_config(tmp_path / "models" / model_dir, shape)
        spec = load_job_spec(yaml.safe_dump(grpo_bench.ferry_job(row, args)), roots=roots)
        grpo = spec.training.grpo
        assert (grpo.num_generations, grpo.max_new_tokens) == (8, 256 if scale == "full" else 16)
        assert spec.offload.gpu_memory_limit == (None if row == "resident" else "24GiB")


def test_the_table_names_a_skipped_row_and_the_ratios() -> None:
    run = {"step_s": 2.0, "generation_s": 1.5, "generation_tokens_per_s": 2730.0, "training_s": 0.5}
    record = {"date": "d", "gpu": "g", "torch": "t", "commit": "c", "limit": "24GiB", "prompts": 2, "generations": 8,
              "new_tokens": 256, "scale": "full",
              "runs": {"resident": run, "limit": {**run, "step_s": 2.5}, "trl": {"status": "skipped: trl is not installed"}}}  # fmt: skip
    table = grpo_bench.markdown(record)
    assert "| TRL GRPOTrainer 8B resident | skipped: trl is not installed |" in table
    assert "limit / resident step: 1.25x (goal <= 1.5x)" in table and "2730.0" in table


def test_a_row_past_its_timeout_is_aborted_with_its_stacks(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import sys

    hung = [sys.executable, "-X", "faulthandler", "-c", "import time\ndef waiting():\n    time.sleep(60)\nwaiting()"]
    assert grpo_bench.run_row(hung, tmp_path / "row.json", timeout=2) == {"status": "timed out after 2 s"}
    assert "in waiting" in capfd.readouterr().err  # faulthandler's dump names the frame it hung in
