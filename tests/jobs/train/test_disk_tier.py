"""``offload.host_memory_limit`` in a job: frozen weights beyond it are read from the checkpoint's safetensors
file on each use (offload/disk.py). The job trains exactly as with every weight in RAM, stays within the
limit (peak RSS, measured in a process of its own), fails naming the file when the file changes under it,
and is refused at submit when neither RAM nor the disk can keep to the limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from jobs import PathRoots, estimate_memory, run_job
from jobs.events import event_to_wire
from jobs.models import build_model
from tests.jobs.helpers import TINY_LM, assert_same_weights, final_weights, merged, spec_from

ROOT = Path(__file__).resolve().parents[3]
MIB = 2**20


def lm_job(hidden: int = 64, layers: int = 12, steps: int = 4) -> dict[str, Any]:
    return merged(
        TINY_LM,
        model={"hidden_size": hidden, "num_layers": layers, "dropout": 0.0, "weights": "lm.safetensors"},
        lora={"target_modules": ["to_q", "to_v"], "rank": 4},
        offload={"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_budget": None},
        training={"steps": steps},
        checkpoint={"save_final": True},
    )


def write_weights(data: dict[str, Any], roots: PathRoots) -> Path:
    """The job's model, seeded, saved where ``model.weights`` points."""
    spec = spec_from({**data, "model": {**data["model"], "weights": None}}, roots)
    model, _ = build_model(spec.model, 0)
    path = roots.model_roots[0] / data["model"]["weights"]
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def run(data: dict[str, Any], roots: PathRoots, out: Path, report: Any = None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    def collect(event: Any) -> None:
        events.append(event_to_wire(event))
        if report is not None:
            report(event)

    run_job(spec_from(data, roots), output_dir=out, report=collect)
    return events


def limit_for(data: dict[str, Any], roots: PathRoots, fraction: float) -> int:
    """``fraction`` of the job's pinned host memory with every weight in RAM."""
    return int(fraction * estimate_memory(spec_from(data, roots)).pinned_host_bytes)


def test_a_job_under_its_host_limit_trains_as_the_all_ram_job(tmp_path: Path, roots: PathRoots) -> None:
    data = lm_job()
    write_weights(data, roots)
    in_ram = run(data, roots, tmp_path / "ram")
    limited = merged(data, offload={**data["offload"], "host_memory_limit": limit_for(data, roots, 0.5)})
    on_disk = run(limited, roots, tmp_path / "disk")

    losses = [e["loss"] for e in in_ram if e["type"] == "step"]
    assert losses and [e["loss"] for e in on_disk if e["type"] == "step"] == losses  # bitwise, step by step
    assert_same_weights(final_weights(tmp_path / "ram"), final_weights(tmp_path / "disk"))
    last = [e for e in on_disk if e["type"] == "step"][-1]["offload"]
    assert last["disk_read_bytes"] > 0 and last["disk_weight_bytes"] > 0
    said = [e["message"] for e in on_disk if e["type"] == "log" and "host_memory_limit" in e["message"]]
    assert said and "are read from lm.safetensors on each use" in said[0]
    estimate = estimate_memory(spec_from(limited, roots))
    assert estimate.disk_bytes == last["disk_weight_bytes"] and estimate.host_limit_fits


@pytest.mark.parametrize("fault", ["truncated", "rewritten"])
def test_a_weights_file_changed_mid_job_fails_it_naming_the_file(tmp_path: Path, roots: PathRoots, fault: str) -> None:
    data = lm_job(steps=6)
    path = write_weights(data, roots)
    limited = merged(data, offload={**data["offload"], "host_memory_limit": limit_for(data, roots, 0.5)})

    def damage_after_step_2(event: Any) -> None:
        if getattr(event, "type", None) != "step" or event.step != 2:
            return
        if fault == "truncated":
            with path.open("r+b") as handle:
                handle.truncate(path.stat().st_size - 4096)
        else:  # the same size, other bytes: another save over it
            data = bytearray(path.read_bytes())
            data[-4096:] = bytes(4096)
            path.write_bytes(bytes(data))

    events: list[dict[str, Any]] = []
    with pytest.raises(Exception, match=f"model weights file {path} changed on disk"):
        run_job(spec_from(limited, roots), output_dir=tmp_path / "out", report=lambda e: (
            events.append(event_to_wire(e)), damage_after_step_2(e)))  # fmt: skip
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2]  # no step on other weights
    failed = events[-1]
    assert failed["type"] == "failed" and str(path) in failed["message"]
