"""The runner keeps the objects a job's setup made out of the garbage collector's walks while it trains.

A full collection walks every tracked object in the process: with a 60-layer DiT and its LoRA that was
0.33-0.45 s on the H200 machine's host, landing in the middle of every few steps (bench/RESULTS.md).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from jobs import run_job
from jobs.events import event_to_wire
from tests.jobs.helpers import TOY, spec_from


def test_setup_objects_are_frozen_during_the_steps_and_given_back_after(tmp_path: Path) -> None:
    frozen_before = gc.get_freeze_count()
    seen: list[int] = []

    def report(event: Any) -> None:
        if event_to_wire(event)["type"] == "step":
            seen.append(gc.get_freeze_count())

    run_job(spec_from(TOY), output_dir=tmp_path, report=report)
    assert seen and min(seen) > frozen_before  # the model, optimizer and engine were frozen before step 1
    assert gc.get_freeze_count() == frozen_before  # and handed back to the collector when the job ended


def test_a_failing_job_unfreezes_too(tmp_path: Path) -> None:
    frozen_before = gc.get_freeze_count()

    def report(event: Any) -> None:
        if event_to_wire(event)["type"] == "step":
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_job(spec_from(TOY), output_dir=tmp_path, report=report)
    assert gc.get_freeze_count() == frozen_before
