"""run_job end to end on the CPU: events, exact resume, pause and cancel, failures and the OOM hint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import jobs.train.runner
from jobs import JobOutcome, OutOfMemoryHint, PathRoots, list_checkpoints, run_job
from jobs.data import build_data
from jobs.events import event_to_wire
from tests.jobs.helpers import TINY_LM, TOY, assert_same_weights, final_weights, merged, spec_from

STEP_KEYS = {
    "type",
    "step",
    "total_steps",
    "loss",
    "lr",
    "samples_per_s",
    "tokens_per_s",
    "elapsed_s",
    "eta_s",
    "device_allocated_bytes",
    "device_reserved_bytes",
    "device_peak_bytes",
    "host_rss_bytes",
    "device_peak_reserved_bytes",
    "pinned_bytes",
    "offload",
    "preference",
    "grpo",
    "ranks",
}

OFFLOAD_BOTH = {"enable_model_cpu_offload": True, "enable_optimizer_cpu_offload": True}


class Killed(Exception):
    """Stands in for the process dying right after a checkpoint."""


def run(data: dict[str, Any], out: Path, roots: PathRoots | None = None, **kwargs: Any) -> tuple[JobOutcome, list]:
    """Run ``data``; return the outcome and the events in their wire form (which refuses undeclared ones)."""
    events: list[dict[str, Any]] = []
    outcome = run_job(
        spec_from(data, roots), output_dir=out, report=lambda e: events.append(event_to_wire(e)), **kwargs
    )
    return outcome, events


def test_events_match_the_interface(tmp_path: Path) -> None:
    data = merged(TOY, offload=OFFLOAD_BOTH, checkpoint={"every_steps": 4, "keep_last": 2})
    outcome, events = run(data, tmp_path)
    assert outcome == JobOutcome("succeeded", 10, str(tmp_path / "checkpoints" / "step-00000010"))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert set(events[0]) == {"type", "total_steps", "resumed_from_step", "spec", "device", "load"}
    assert events[0]["load"]["source"] == "in_memory" and events[0]["load"]["peak_host_rss_bytes"] > 0
    assert events[0]["device"]["type"] == "cpu" and events[0]["device"]["uuid"] is None
    assert events[0]["resumed_from_step"] is None and events[0]["spec"]["name"] == "toy"
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 11))
    assert all(set(e) == STEP_KEYS for e in steps)
    assert set(steps[0]["offload"]) >= {"h2d_bytes", "d2h_bytes", "pinned_reserved_bytes", "last_step_h2d_gbps"}
    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    assert [e["step"] for e in checkpoints] == [4, 8, 10]
    assert set(checkpoints[0]) == {"type", "step", "name", "path", "files"}
    assert {f["name"] for f in checkpoints[0]["files"]} == {"model.safetensors", "training_state.pt"}
    assert events[-1] == {"type": "finished", "status": "succeeded", "step": 10}
    json.dumps(events)
    assert [c.step for c in list_checkpoints(tmp_path)] == [8, 10]  # keep_last: 2


def test_loss_goes_down_and_lr_follows_the_schedule(tmp_path: Path) -> None:
    data = merged(TOY, training={"steps": 30, "scheduler": {"kind": "linear", "warmup_steps": 5}})
    _, events = run(data, tmp_path)
    steps = [e for e in events if e["type"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[0]["lr"] == pytest.approx(1e-2 / 5) and steps[4]["lr"] == pytest.approx(1e-2)
    assert steps[-1]["lr"] < steps[5]["lr"]


@pytest.mark.parametrize(
    "offload",
    [{}, {"enable_model_cpu_offload": True}, OFFLOAD_BOTH, {**OFFLOAD_BOTH, "gpu_memory_budget": "auto"}],
    ids=["no-offload", "model-offload", "optimizer-offload", "auto-budget"],
)
def test_offload_trains_the_same_weights_on_cpu(tmp_path: Path, offload: dict) -> None:
    run(TOY, tmp_path / "plain")
    run(merged(TOY, offload=offload), tmp_path / "offloaded")
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "offloaded"))


def test_gradient_accumulation_with_optimizer_offload_trains_the_same_weights(tmp_path: Path) -> None:
    data = merged(TOY, training={"gradient_accumulation_steps": 4, "max_grad_norm": 1.0})
    run(data, tmp_path / "plain")
    run(merged(data, offload=OFFLOAD_BOTH), tmp_path / "offloaded")
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "offloaded"))


@pytest.mark.parametrize(
    "offload", [{"enable_model_cpu_offload": True}, OFFLOAD_BOTH], ids=["model-offload", "optimizer-offload"]
)
def test_lora_through_the_engine_trains_the_same_adapters(tmp_path: Path, roots: PathRoots, offload: dict) -> None:
    data = merged(TINY_LM, lora={"target_modules": ["to_q", "to_v"], "rank": 4}, training={"steps": 4})
    run(data, tmp_path / "plain", roots)
    run(merged(data, offload=offload), tmp_path / "offloaded", roots)
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "offloaded"))


@pytest.mark.parametrize("reuse", [True, False])
def test_offload_reuse_ring_slots_reaches_the_engine(tmp_path: Path, roots: PathRoots, reuse: bool) -> None:
    """The frozen base streams; with reuse (the default) the turnarounds' units are not copied again, and the
    trained adapters are the same either way."""
    data = merged(TINY_LM, lora={"target_modules": ["to_q", "to_v"], "rank": 4}, training={"steps": 4})
    offload = {"enable_model_cpu_offload": True, "granularity": "block", "reuse_ring_slots": reuse}
    run(data, tmp_path / "plain", roots)
    _, events = run(merged(data, offload=offload), tmp_path / "offloaded", roots)
    reused = [e["offload"]["reused_bytes"] for e in events if e["type"] == "step"]
    assert (reused[-1] > 0) is reuse
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "offloaded"))


def test_epochs_count_steps_from_the_data(tmp_path: Path, roots: PathRoots) -> None:
    data = merged(TINY_LM, training={"steps": None, "epochs": 2, "gradient_accumulation_steps": 2})
    data["training"].pop("steps")
    spec = spec_from(data, roots)
    source, _ = build_data(spec.data, batch_size=2, seed=0)
    outcome, events = run(data, tmp_path, roots)
    assert events[0]["total_steps"] == 2 * source.batches_per_epoch // 2 == outcome.step
    first_step = next(e for e in events if e["type"] == "step")
    assert first_step["tokens_per_s"] == pytest.approx(first_step["samples_per_s"] * 32)


def test_bf16_mixed_precision_on_cpu(tmp_path: Path) -> None:
    outcome, events = run(merged(TOY, training={"mixed_precision": "bf16"}, offload=OFFLOAD_BOTH), tmp_path)
    assert outcome.status == "succeeded"
    assert all(e["loss"] == e["loss"] for e in events if e["type"] == "step")  # no NaN


def interrupted_then_resumed(data: dict[str, Any], out: Path, roots: PathRoots | None = None) -> list:
    """Run until the step-5 checkpoint, die, then resume to the end; return the resumed run's events."""

    def die_after_step_5(event: Any) -> None:
        if event.type == "checkpoint" and event.step == 5:
            raise Killed

    with pytest.raises(Killed):
        run_job(spec_from(data, roots), output_dir=out, report=die_after_step_5)
    return run(data, out, roots)[1]


@pytest.mark.parametrize(
    "offload",
    # The budget's 20000 bytes keep the first layer on the device with its optimizer (4 x 4224 bytes) and hold
    # a little of the rest from forward to backward: a checkpoint has state on both sides.
    [{}, OFFLOAD_BOTH, {**OFFLOAD_BOTH, "gpu_memory_budget": 20000}],
    ids=["no-offload", "optimizer-offload", "optimizer-offload-with-budget"],
)
def test_resume_is_exact_for_full_training(tmp_path: Path, offload: dict) -> None:
    data = merged(
        TOY,
        offload=offload,
        checkpoint={"every_steps": 5},
        training={"scheduler": {"kind": "cosine", "warmup_steps": 2}, "max_grad_norm": 1.0},
    )
    run(data, tmp_path / "straight")
    events = interrupted_then_resumed(data, tmp_path / "resumed")
    assert events[0]["resumed_from_step"] == 5
    assert [e["step"] for e in events if e["type"] == "step"] == [6, 7, 8, 9, 10]
    assert_same_weights(final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed"))


def test_resume_is_exact_for_lora_with_dropout_on_text(tmp_path: Path, roots: PathRoots) -> None:
    # Dropout draws from the RNG and the text order is shuffled per epoch: both must continue exactly.
    data = merged(
        TINY_LM,
        lora={"target_modules": ["to_q", "to_v", "mlp.net.0"], "rank": 4, "dropout": 0.1},
        offload={"enable_model_cpu_offload": True},
        checkpoint={"every_steps": 5},
        training={"gradient_accumulation_steps": 2},
    )
    run(data, tmp_path / "straight", roots)
    interrupted_then_resumed(data, tmp_path / "resumed", roots)
    assert_same_weights(final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed"))


def test_resume_after_sigkill(tmp_path: Path) -> None:
    data = merged(TOY, checkpoint={"every_steps": 5})
    run(data, tmp_path / "straight")
    script = f"""
import os, signal, torch
torch.set_num_threads(1)
from jobs import load_job_spec, run_job
def report(event):
    if event.type == "checkpoint" and event.step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
run_job(load_job_spec({json.dumps(json.dumps(data))}), output_dir={str(tmp_path / "resumed")!r}, report=report)
"""
    child = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[3])
    assert child.returncode == -signal.SIGKILL
    assert [c.step for c in list_checkpoints(tmp_path / "resumed")] == [5]
    run(data, tmp_path / "resumed")
    assert_same_weights(final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed"))


def test_pause_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    run(TOY, tmp_path / "straight")
    polls = iter([None, None, None, "pause"])
    outcome, events = run(TOY, tmp_path / "paused", should_stop=lambda: next(polls, None))
    assert outcome.status == "paused" and outcome.step == 3
    assert outcome.checkpoint == str(tmp_path / "paused" / "checkpoints" / "step-00000003")
    assert events[-1] == {"type": "finished", "status": "paused", "step": 3}
    outcome, _ = run(TOY, tmp_path / "paused")
    assert outcome.status == "succeeded"
    assert_same_weights(final_weights(tmp_path / "straight"), final_weights(tmp_path / "paused"))


def test_cancel_stops_without_a_checkpoint(tmp_path: Path) -> None:
    polls = iter([None, None, "cancel"])
    outcome, events = run(TOY, tmp_path, should_stop=lambda: next(polls, None))
    assert outcome == JobOutcome("cancelled", 2, None)
    assert events[-1] == {"type": "finished", "status": "cancelled", "step": 2}
    assert list_checkpoints(tmp_path) == []


def test_resume_false_starts_over(tmp_path: Path) -> None:
    run(TOY, tmp_path)
    _, events = run(TOY, tmp_path, resume=False)
    assert events[0]["resumed_from_step"] is None and events[1]["step"] == 1


def test_out_of_memory_names_the_setting_that_helps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(jobs.train.runner, "train_step", no_memory)
    events: list[dict] = []
    with pytest.raises(OutOfMemoryHint, match="set offload.enable_model_cpu_offload: true") as caught:
        run_job(spec_from(TOY), output_dir=tmp_path, report=lambda e: events.append(event_to_wire(e)))
    assert isinstance(caught.value, RuntimeError)
    assert events[-1] == {
        "type": "failed",
        "error": "out_of_memory",
        "message": str(caught.value),
        "exception": "OutOfMemoryHint",
    }
    assert "at step 1: CUDA out of memory. Tried to allocate 2.00 GiB" in str(caught.value)


def test_errors_are_reported_then_raised(tmp_path: Path, roots: PathRoots) -> None:
    data = merged(TINY_LM, model={"vocab_size": 300}, data={"seq_len": 5000})
    events: list[dict] = []
    small = merged(data, data={"seq_len": 32}, training={"batch_size": 4096})
    with pytest.raises(ValueError, match="fewer than training.batch_size=4096"):
        run_job(spec_from(small, roots), output_dir=tmp_path, report=lambda e: events.append(event_to_wire(e)))
    assert (events[-1]["type"], events[-1]["error"], events[-1]["exception"]) == (
        "failed",
        "training_error",
        "ValueError",
    )


def test_settings_ignored_without_model_offload_are_logged(tmp_path: Path) -> None:
    _, events = run(merged(TOY, offload={"prefetch": 2}), tmp_path)
    logs = [e for e in events if e["type"] == "log"]
    assert logs and logs[0]["level"] == "warning" and "offload.prefetch ignored" in logs[0]["message"]


def test_train_step_can_be_called_directly() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    class NoAccelerator:
        def autocast(self) -> Any:
            return torch.autocast("cpu", enabled=False)

        def backward(self, loss: torch.Tensor) -> None:
            loss.backward()

    batch = {"x": torch.ones(2, 4)}
    before = model.weight.detach().clone()
    loss = jobs.train.runner.train_step(
        model,
        lambda m, b: m(b["x"]).pow(2).mean(),
        [batch, batch],
        optimizer=optimizer,
        scheduler=scheduler,
        accelerator=NoAccelerator(),
        manager=None,
        max_grad_norm=None,
        device=torch.device("cpu"),
    )
    assert loss.ndim == 0 and not torch.equal(before, model.weight)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "offload",
    [{"enable_model_cpu_offload": True}, OFFLOAD_BOTH, {**OFFLOAD_BOTH, "granularity": "block", "prefetch": 2}],
    ids=["model-offload", "optimizer-offload", "block-prefetch"],
)
def test_offload_on_cuda_matches_plain_training(tmp_path: Path, offload: dict) -> None:
    data = merged(TOY, device="cuda", model={"hidden_size": 512})
    _, plain = run(data, tmp_path / "plain")
    _, offloaded = run(merged(data, offload=offload), tmp_path / "offloaded")
    losses = [[e["loss"] for e in events if e["type"] == "step"] for events in (plain, offloaded)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    steps = [e for e in offloaded if e["type"] == "step"]
    assert steps[-1]["offload"]["h2d_bytes"] > 0 and steps[-1]["device_peak_bytes"] > 0
    # Host copies exist only for what streams: with every toy weight trainable and the optimizer on the
    # device, model offload alone keeps the weights on the device and pins nothing.
    assert (steps[-1]["pinned_bytes"] > 0) == offload.get("enable_optimizer_cpu_offload", False)


@pytest.mark.gpu
def test_real_cuda_out_of_memory_becomes_a_hint(tmp_path: Path) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total)  # pretend the GPU has 2 GiB
    try:
        data = merged(TOY, device="cuda", model={"hidden_size": 8192, "num_layers": 8})  # 2 GiB of weights
        with pytest.raises(OutOfMemoryHint, match="set offload.enable_model_cpu_offload: true"):
            run(data, tmp_path)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_delayed_update_is_exact_through_its_warmup_and_then_trains(tmp_path: Path) -> None:
    steps = TOY["training"]["steps"]
    delayed = {**OFFLOAD_BOTH, "delayed_update": True, "delayed_update_warmup_steps": steps}
    run(TOY, tmp_path / "plain")
    run(merged(TOY, offload=delayed), tmp_path / "warmup-only")
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "warmup-only"))
    _, events = run(merged(TOY, offload={**delayed, "delayed_update_warmup_steps": 2}), tmp_path / "delayed")
    losses = [e["loss"] for e in events if e["type"] == "step"]
    assert len(losses) == steps and losses[-1] < losses[0]


@pytest.mark.parametrize("offload", [{"enable_model_cpu_offload": True}, OFFLOAD_BOTH], ids=["model", "optimizer"])
def test_quantized_base_offloaded_trains_the_same_adapters_as_resident(
    tmp_path: Path, roots: PathRoots, offload: dict
) -> None:
    pytest.importorskip("torchao")
    data = merged(
        TINY_LM,
        model={"quantize": "int8", "dropout": 0.0},  # the tiny model's linears are too small for NF4's blocks
        lora={"target_modules": ["to_q", "to_v"], "rank": 4},
        training={"steps": 3},
    )
    run(data, tmp_path / "resident", roots)
    run(merged(data, offload=offload), tmp_path / "offloaded", roots)
    assert_same_weights(final_weights(tmp_path / "resident"), final_weights(tmp_path / "offloaded"))


def test_quantize_needs_lora(roots: PathRoots) -> None:
    with pytest.raises(ValueError, match=r"model.quantize.*add a lora section"):
        spec_from(merged(TINY_LM, model={"quantize": "nf4"}), roots)


def test_a_job_returns_its_pinned_memory_once_its_model_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freed pinned tensors go to torch's host allocator cache, not to the system: a 50 GB arena stayed held by
    a process that ran the next job (a cache job's text encoder, then a DiT: the host ran out of memory). The
    job empties that cache at its end, after the session, with the model and its host copies, is gone."""
    import weakref

    models: list[weakref.ref] = []
    seen: list[bool] = []
    open_session = jobs.train.runner.open_session

    def watched(*args: Any, **kwargs: Any) -> Any:
        session = open_session(*args, **kwargs)
        models.append(weakref.ref(session.model))
        return session

    monkeypatch.setattr(jobs.train.runner, "open_session", watched)
    monkeypatch.setattr(jobs.train.runner, "return_cached_host_memory", lambda: seen.append(models[0]() is None))
    outcome, _ = run(merged(TOY, offload=OFFLOAD_BOTH), tmp_path / "out")
    assert outcome.status == "succeeded"
    assert seen == [True]
