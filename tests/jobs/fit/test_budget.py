"""``offload.gpu_memory_budget: auto`` (the default) decided from the estimate: on the CPU, where nothing is
measured, it follows ``gpu_memory_limit`` exactly, and trains bitwise alike an explicit budget of its size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jobs import PathRoots, estimate_memory, run_job
from jobs.events import event_to_wire
from jobs.fit.budget import decide_budget
from offload.auto_budget import MIN_MARGIN_BYTES
from tests.jobs.helpers import TINY_LM, TOY, assert_same_weights, final_weights, merged, spec_from

MODEL = {"enable_model_cpu_offload": True}
BOTH = {**MODEL, "enable_optimizer_cpu_offload": True}
BIG_TOY = merged(TOY, model={"hidden_size": 256, "num_layers": 4}, training={"steps": 4})


LORA_LM = merged(TINY_LM, lora={"target_modules": ["to_q", "to_v"], "rank": 4}, training={"steps": 4})


def _streamed_peak_and_weights(
    offload: dict[str, Any], base: dict[str, Any] = BIG_TOY, roots: PathRoots | None = None
) -> tuple[int, int]:
    streamed = estimate_memory(spec_from(merged(base, offload={**offload, "gpu_memory_budget": None}), roots))
    return streamed.peak_device_bytes, streamed.weight_bytes


def test_the_default_budget_is_auto() -> None:
    assert spec_from(merged(TOY, offload=MODEL)).offload.gpu_memory_budget == "auto"


@pytest.mark.parametrize("offload", [MODEL, BOTH], ids=["model", "optimizer"])
def test_auto_keeps_everything_when_it_fits_a_cpu_limit(offload: dict[str, Any]) -> None:
    peak, weights = _streamed_peak_and_weights(offload)
    limit = MIN_MARGIN_BYTES + peak + 2 * weights
    decision = decide_budget(spec_from(merged(BIG_TOY, offload={**offload, "gpu_memory_limit": limit})))
    assert decision is not None
    assert decision.engine_budget == 2 * weights and decision.resident_bytes == decision.weight_bytes == weights
    assert decision.message.startswith("offload.gpu_memory_budget auto -> ")
    assert "resident of" in decision.message and "offload.gpu_memory_limit" in decision.message


def test_auto_keeps_what_fits_and_streams_the_rest() -> None:
    peak, weights = _streamed_peak_and_weights(MODEL)
    spec = spec_from(merged(BIG_TOY, offload={**MODEL, "gpu_memory_limit": MIN_MARGIN_BYTES + peak + weights // 2}))
    decision = decide_budget(spec)
    assert decision is not None and decision.engine_budget == decision.resident_bytes == weights // 2
    # The estimate of the job counts what auto keeps: it fills the limit up to the margin.
    assert estimate_memory(spec).peak_device_bytes == peak + weights // 2


def test_auto_streams_everything_when_nothing_fits_or_no_limit_is_known() -> None:
    tight = decide_budget(spec_from(merged(BIG_TOY, offload={**MODEL, "gpu_memory_limit": MIN_MARGIN_BYTES})))
    unknown = decide_budget(spec_from(merged(BIG_TOY, offload=MODEL)))
    assert tight is not None and unknown is not None
    assert tight.engine_budget is None and tight.resident_bytes == 0
    assert unknown.engine_budget is None and "no offload.gpu_memory_limit" in unknown.message
    assert decide_budget(spec_from(merged(BIG_TOY, offload={**MODEL, "gpu_memory_budget": None}))) is None


def _run(data: dict[str, Any], out: Path, roots: PathRoots) -> tuple[list[float], list[str], int]:
    """The losses, the log messages and the weight bytes kept resident at the end."""
    events: list[dict[str, Any]] = []
    run_job(spec_from(data, roots), output_dir=out, report=lambda e: events.append(event_to_wire(e)))
    steps = [e for e in events if e["type"] == "step"]
    messages = [e["message"] for e in events if e["type"] == "log"]
    return [e["loss"] for e in steps], messages, steps[-1]["offload"]["kept_resident_bytes"]


@pytest.mark.parametrize("offload", [MODEL, BOTH], ids=["model", "optimizer"])
@pytest.mark.parametrize("share", [2, 0], ids=["everything-resident", "half-resident"])
def test_auto_trains_bitwise_alike_the_explicit_budget_it_chose(
    tmp_path: Path, roots: PathRoots, offload: dict[str, Any], share: int
) -> None:
    """A LoRA job: its frozen base is what a budget keeps."""
    peak, weights = _streamed_peak_and_weights(offload, LORA_LM, roots)
    room = 2 * weights if share else weights // 2
    limited = {**offload, "gpu_memory_limit": MIN_MARGIN_BYTES + peak + room}
    auto_losses, messages, auto_kept = _run(merged(LORA_LM, offload=limited), tmp_path / "auto", roots)
    fixed = merged(LORA_LM, offload={**limited, "gpu_memory_budget": room})
    fixed_losses, _, fixed_kept = _run(fixed, tmp_path / "fixed", roots)
    assert auto_losses == fixed_losses
    assert auto_kept == fixed_kept > 0
    assert_same_weights(final_weights(tmp_path / "auto"), final_weights(tmp_path / "fixed"))
    assert any(m.startswith("offload.gpu_memory_budget auto -> ") for m in messages)
