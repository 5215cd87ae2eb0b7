"""Data parallelism on the CPU with two gloo ranks: the ranks together train what one rank does with their
union batch (losses and weights within float summation order), rank 0 alone writes checkpoints and events,
a checkpoint resumes on another number of ranks, a stop request reaches every rank."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

import psutil
import pytest
import torch
from torch.testing import assert_close

from jobs import JobOutcome, PathRoots, run_job
from jobs.errors import RankLost
from jobs.events import event_to_wire
from tests.jobs.helpers import TINY_LM, TOY, final_weights, merged, spec_from

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


def resume_from_step_2(source: Path, out: Path, world_size: int, batch_size: int) -> dict[str, torch.Tensor]:
    """Resume ``source``'s step-2 checkpoint in ``out`` on ``world_size`` ranks; the final weights."""
    shutil.copytree(source / "checkpoints" / "step-00000002", out / "checkpoints" / "step-00000002")
    outcome, events = run(on_ranks(OPTIMIZER_OFFLOAD, world_size, batch_size), out)
    assert outcome.status == "succeeded" and events[0]["resumed_from_step"] == 2
    assert [e["step"] for e in events if e["type"] == "step"] == [3, 4]
    return final_weights(out)


def test_optimizer_offload_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    """A full fine-tune with model and optimizer offload (gradients reduced before their copy to the host,
    the CPU optimizer overlapped) trains what one rank does, and its checkpoint, which holds nothing of a
    rank's own, resumes on one rank to the same end."""
    run(on_ranks(OPTIMIZER_OFFLOAD, 1, 8), tmp_path / "one")
    run(on_ranks(OPTIMIZER_OFFLOAD, 2, 4), tmp_path / "two")
    straight = final_weights(tmp_path / "one")
    assert_close_weights(final_weights(tmp_path / "two"), straight)
    assert_close_weights(resume_from_step_2(tmp_path / "two", tmp_path / "resumed", 1, 8), straight)


def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path: Path) -> None:
    run(on_ranks(OPTIMIZER_OFFLOAD, 1, 8), tmp_path / "one")
    resumed = resume_from_step_2(tmp_path / "one", tmp_path / "resumed", 2, 4)
    assert_close_weights(resumed, final_weights(tmp_path / "one"))


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
