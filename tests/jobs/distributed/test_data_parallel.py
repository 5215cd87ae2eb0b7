"""Data parallelism on the CPU with two gloo ranks: the ranks together train what one rank does with their
union batch (losses and weights within float summation order), rank 0 alone writes checkpoints and events,
a checkpoint resumes on another number of ranks, a stop request reaches every rank. Under optimizer offload the
ranks split the CPU optimizer's state, each holding its half, and checkpoints hold it whole."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Literal

import psutil
import pytest
import torch
from torch.testing import assert_close

from jobs import JobOutcome, PathRoots, run_job
from jobs.checkpoints.training_state import load_training_state
from jobs.errors import RankLost
from jobs.events import event_to_wire
from jobs.fit.host_memory import RANK_PROCESS_HOST_BYTES
from tests.jobs.helpers import TINY_LM, TOY, assert_same_weights, final_weights, merged, spec_from

OFFLOAD_BOTH = {"enable_model_cpu_offload": True, "enable_optimizer_cpu_offload": True}
# Two ranks against one: the same rows, reduced in another order (two half-batch matmuls and a sum instead of
# one). float32 rounding stays near 1e-7 of a value; the tolerances leave room for a few steps of it.
RTOL, ATOL = 1e-5, 1e-6


def run(data: dict[str, Any], out: Path, roots: PathRoots | None = None, **kwargs: Any) -> tuple[JobOutcome, list]:
    events: list[dict[str, Any]] = []
    outcome = run_job(
        spec_from(data, roots), output_dir=out, report=lambda e: events.append(event_to_wire(e)), **kwargs
    )
    return outcome, events


def on_ranks(data: dict[str, Any], world_size: int, batch_size: int) -> dict[str, Any]:
    """``data`` on ``world_size`` ranks of ``batch_size`` rows each."""
    return merged(data, distributed={"world_size": world_size}, training={"batch_size": batch_size})


def losses(events: list[dict[str, Any]]) -> list[float]:
    return [e["loss"] for e in events if e["type"] == "step"]


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert_close(a[name], b[name], rtol=RTOL, atol=ATOL, msg=f"{name} differs")


def test_two_ranks_train_what_one_rank_trains_on_their_union_batch(tmp_path: Path) -> None:
    """A resident full fine-tune with gradient accumulation (buckets reduced after the last micro-batch),
    and the events: once, from rank 0, with both ranks' figures."""
    data = merged(TOY, training={"steps": 4, "gradient_accumulation_steps": 2})
    outcome, events = run(on_ranks(data, 2, 4), tmp_path / "two")
    _, union = run(on_ranks(data, 1, 8), tmp_path / "one")
    assert outcome == JobOutcome("succeeded", 4, str(tmp_path / "two" / "checkpoints" / "step-00000004"))
    assert_close(losses(events), losses(union), rtol=RTOL, atol=ATOL)
    assert_close_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))
    kinds = [e["type"] for e in events]
    assert kinds.count("started") == kinds.count("finished") == kinds.count("checkpoint") == 1
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all([r["rank"] for r in e["ranks"]] == [0, 1] for e in steps)
    assert all(r["step_s"] > 0 and r["host_rss_bytes"] > 0 for e in steps for r in e["ranks"])
    # The host check's figure for a rank process stays below what each one holds (jobs/fit/host_memory.py).
    assert all(r["host_rss_bytes"] > RANK_PROCESS_HOST_BYTES for e in steps for r in e["ranks"])
    assert [e["ranks"] for e in union if e["type"] == "step"] == [None] * 4
    assert [p.name for p in (tmp_path / "two" / "checkpoints").iterdir()] == ["step-00000004"]


def test_lora_with_model_offload_on_two_ranks(tmp_path: Path, roots: PathRoots) -> None:
    """LoRA adapters on the device (target cpu), the frozen base streamed by the engine on each rank."""
    data = merged(
        TINY_LM,
        model={"dropout": 0.0},  # a dropout mask depends on the rows a rank holds
        lora={"target_modules": ["to_q", "to_v"], "rank": 4},
        training={"steps": 2},
        offload={"enable_model_cpu_offload": True},
    )
    _, events = run(on_ranks(data, 2, 2), tmp_path / "two", roots)
    _, union = run(on_ranks(data, 1, 4), tmp_path / "one", roots)
    assert_close(losses(events), losses(union), rtol=RTOL, atol=ATOL)
    assert_close_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))


OPTIMIZER_OFFLOAD = merged(
    TOY, offload=OFFLOAD_BOTH, training={"steps": 4}, checkpoint={"every_steps": 2, "keep_last": 5}
)


def resume_from_step_2(source: Path, out: Path, world_size: int, batch_size: int) -> list[dict[str, Any]]:
    """Resume ``source``'s step-2 checkpoint in ``out`` on ``world_size`` ranks; the events."""
    shutil.copytree(source / "checkpoints" / "step-00000002", out / "checkpoints" / "step-00000002")
    outcome, events = run(on_ranks(OPTIMIZER_OFFLOAD, world_size, batch_size), out)
    assert outcome.status == "succeeded" and events[0]["resumed_from_step"] == 2
    assert [e["step"] for e in events if e["type"] == "step"] == [3, 4]
    return events


def optimizer_state(output_dir: Path, step: int) -> dict[int, dict[str, torch.Tensor]]:
    """The optimizer state of ``output_dir``'s checkpoint at ``step``, by parameter index."""
    return load_training_state(output_dir / "checkpoints" / f"step-{step:08d}")["optimizer"]["state"]


def assert_close_state(a: dict[int, dict[str, torch.Tensor]], b: dict[int, dict[str, torch.Tensor]]) -> None:
    assert a.keys() == b.keys()
    for index in a:
        assert a[index].keys() == b[index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in a[index]:
            assert_close(a[index][key], b[index][key], rtol=RTOL, atol=ATOL, msg=f"{index} {key} differs")


def held_by_each_rank(events: list[dict[str, Any]]) -> list[list[int]]:
    """Each step's CPU optimizer state on each rank, in bytes (from the rank's own state tensors)."""
    return [[r.get("optimizer_host_bytes") for r in e["ranks"]] for e in events if e["type"] == "step"]


def parts_of_adamw(weights: dict[str, torch.Tensor], world_size: int) -> list[int]:
    """The bytes of AdamW's state on each of ``world_size`` ranks that split it: two float32 moments of the rank's
    part of every weight (rank 0 the first ceil(n / world_size) elements, ...) and its float32 step count."""
    held = [0] * world_size
    for weight in weights.values():
        chunk = math.ceil(weight.numel() / world_size)
        for rank in range(world_size):
            held[rank] += 2 * 4 * max(0, min(chunk, weight.numel() - rank * chunk)) + 4
    return held


def test_optimizer_offload_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    """A full fine-tune with model and optimizer offload on two ranks that split the CPU optimizer (gradients
    reduce-scattered before their copy to the host, each rank stepping its half of every weight, the weights
    all-gathered after the step) trains what one rank does on the union batch (gloo sums the two ranks' halves
    of the mean: another float32 summation order than one rank's mean of the whole batch). Each rank holds half
    the optimizer state; the checkpoint holds it whole, as one rank does, and resumes on one rank to the same
    end, and on two ranks to the very same bits."""
    _, one = run(on_ranks(OPTIMIZER_OFFLOAD, 1, 8), tmp_path / "one")
    _, two = run(on_ranks(OPTIMIZER_OFFLOAD, 2, 4), tmp_path / "two")
    straight = final_weights(tmp_path / "one")
    assert_close(losses(two), losses(one), rtol=RTOL, atol=ATOL)
    assert_close_weights(final_weights(tmp_path / "two"), straight)
    whole, halves = parts_of_adamw(straight, 1), parts_of_adamw(straight, 2)
    assert held_by_each_rank(two) == [halves] * 4 and sum(halves) < 1.1 * whole[0]
    assert [e["offload"]["optimizer_host_bytes"] for e in one if e["type"] == "step"][1:] == whole * 3
    assert_close_state(optimizer_state(tmp_path / "two", 2), optimizer_state(tmp_path / "one", 2))

    resume_from_step_2(tmp_path / "two", tmp_path / "resumed", 1, 8)
    assert_close_weights(final_weights(tmp_path / "resumed"), straight)
    assert_close_state(optimizer_state(tmp_path / "resumed", 4), optimizer_state(tmp_path / "one", 4))
    again = resume_from_step_2(tmp_path / "two", tmp_path / "again", 2, 4)
    assert held_by_each_rank(again) == [halves] * 2
    assert_same_weights(final_weights(tmp_path / "again"), final_weights(tmp_path / "two"))


def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path: Path) -> None:
    """Each rank takes its half of the one rank's whole optimizer state and the two continue as it does."""
    run(on_ranks(OPTIMIZER_OFFLOAD, 1, 8), tmp_path / "one")
    events = resume_from_step_2(tmp_path / "one", tmp_path / "resumed", 2, 4)
    straight = final_weights(tmp_path / "one")
    assert held_by_each_rank(events) == [parts_of_adamw(straight, 2)] * 2
    assert_close_weights(final_weights(tmp_path / "resumed"), straight)
    assert_close_state(optimizer_state(tmp_path / "resumed", 4), optimizer_state(tmp_path / "one", 4))


def test_a_cancel_reaches_every_rank(tmp_path: Path) -> None:
    """Rank 0 reads the request and broadcasts it: both ranks stop before the same step and the job returns."""
    events: list[dict[str, Any]] = []

    def should_stop() -> Literal["cancel"] | None:
        return "cancel" if any(e["type"] == "step" for e in events) else None

    spec = spec_from(on_ranks(merged(TOY, training={"steps": 100_000}), 2, 4))
    outcome = run_job(
        spec, output_dir=tmp_path, report=lambda e: events.append(event_to_wire(e)), should_stop=should_stop
    )
    assert outcome.status == "cancelled" and 1 <= outcome.step < 100_000
    assert events[-1] == {"type": "finished", "status": "cancelled", "step": outcome.step}
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_lost_rank_ends_the_attempt_as_interrupted(tmp_path: Path) -> None:
    """A rank killed mid-run: the launcher ends the others and reports an interrupted failure (the service
    then resumes the job from its last checkpoint)."""
    events: list[dict[str, Any]] = []
    killed: list[int] = []

    def kill_a_rank_after_a_step() -> None:
        if killed or not any(e["type"] == "step" for e in events):
            return None
        ranks = [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
        ranks = [p for p in ranks if "resource_tracker" not in " ".join(p.cmdline())]
        ranks[-1].kill()
        killed.append(ranks[-1].pid)
        return None

    spec = spec_from(on_ranks(merged(TOY, training={"steps": 100_000}), 2, 4))
    with pytest.raises(RankLost, match=r"a rank of 2 ended without finishing: rank \d \(signal SIGKILL\)"):
        run_job(
            spec,
            output_dir=tmp_path,
            report=lambda e: events.append(event_to_wire(e)),
            should_stop=kill_a_rank_after_a_step,
        )
    assert killed and events[-1]["type"] == "failed" and events[-1]["error"] == "interrupted"
    assert not any(psutil.pid_exists(pid) for pid in killed)  # reaped: the launcher waited for it
    assert not [
        p
        for p in psutil.Process().children(recursive=True)
        if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
    ]  # the other rank was ended too


def test_a_pause_checkpoints_once_and_the_job_resumes_on_one_rank(tmp_path: Path) -> None:
    """Rank 0 checkpoints where every rank stopped; the other rank writes nothing."""
    events: list[dict[str, Any]] = []

    def should_stop() -> Literal["pause"] | None:
        return "pause" if any(e["type"] == "step" for e in events) else None

    data = merged(TOY, training={"steps": 100_000})
    outcome = run_job(
        spec_from(on_ranks(data, 2, 4)),
        output_dir=tmp_path,
        report=lambda e: events.append(event_to_wire(e)),
        should_stop=should_stop,
    )
    assert outcome.status == "paused" and outcome.checkpoint is not None
    assert [e["step"] for e in events if e["type"] == "checkpoint"] == [outcome.step]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [Path(outcome.checkpoint).name]
    resumed, later = run(on_ranks(merged(data, training={"steps": outcome.step + 1}), 1, 8), tmp_path)
    assert resumed.status == "succeeded" and later[0]["resumed_from_step"] == outcome.step


def test_the_same_error_on_every_rank_fails_the_job_with_it(tmp_path: Path, roots: PathRoots) -> None:
    """The corpus removed after the spec was accepted: every rank raises the same error reading it. The job
    fails with that error, not as a lost rank that the service would retry until "interrupted 4 times"."""
    spec = spec_from(on_ranks(merged(TINY_LM, training={"steps": 2}), 2, 1), roots)
    shutil.rmtree(roots.data_roots[0] / "corpus")
    events: list[dict[str, Any]] = []
    with pytest.raises(RuntimeError, match="every rank failed: ") as raised:
        run_job(spec, output_dir=tmp_path / "out", report=lambda e: events.append(event_to_wire(e)))
    assert not isinstance(raised.value, RankLost)
    failed = events[-1]
    assert failed["type"] == "failed" and failed["error"] == "training_error", failed
    assert str(raised.value) == f"every rank failed: {failed['message']}"
