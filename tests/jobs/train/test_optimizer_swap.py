"""``offload.host_memory_limit`` on a full fine-tune: the CPU optimizer's state beyond it lives in swap files in
the job's output folder (offload/optimizer_swap.py). The job trains bitwise as with the state in memory, resumes
from a checkpoint, stays within the limit (peak RSS, measured in a process of its own), and fails naming the
file when a swap file is truncated under it; the fit check says so."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from jobs import PathRoots, estimate_memory, run_job
from jobs.events import event_to_wire
from tests.jobs.helpers import TINY_LM, assert_same_weights, final_weights, merged, spec_from
from tests.jobs.train.test_disk_tier import measured, run

MIB = 2**20


def full_fine_tune(hidden: int = 64, layers: int = 4, steps: int = 4) -> dict[str, Any]:
    return merged(
        TINY_LM,
        model={"hidden_size": hidden, "num_layers": layers, "dropout": 0.0},
        offload={
            "enable_model_cpu_offload": True,
            "enable_optimizer_cpu_offload": True,
            "granularity": "block",
            "gpu_memory_budget": None,
        },
        training={"steps": steps},
        checkpoint={"save_final": True},
    )


def limited(data: dict[str, Any], roots: PathRoots, share: float = 0.25) -> dict[str, Any]:
    """``data`` with a host limit of its pinned memory plus ``share`` of its optimizer state."""
    estimate = estimate_memory(spec_from(data, roots))
    limit = estimate.pinned_host_bytes + int(share * estimate.optimizer_host_bytes)
    return merged(data, offload={**data["offload"], "host_memory_limit": limit})


def steps_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "step"]


def test_a_full_fine_tune_under_its_limit_swaps_its_optimizer_state_and_trains_as_in_ram(
    tmp_path: Path, roots: PathRoots
) -> None:
    data = full_fine_tune()
    in_ram = run(data, roots, tmp_path / "ram")
    swapped_data = limited(data, roots)
    swapped = run(swapped_data, roots, tmp_path / "swap")

    assert [e["loss"] for e in steps_of(swapped)] == [e["loss"] for e in steps_of(in_ram)]  # bitwise
    assert_same_weights(final_weights(tmp_path / "ram"), final_weights(tmp_path / "swap"))
    last = steps_of(swapped)[-1]["offload"]
    assert last["optimizer_swap_bytes"] > 0 and last["optimizer_swap_read_bytes"] > 0
    assert last["optimizer_host_bytes"] < steps_of(in_ram)[-1]["offload"]["optimizer_host_bytes"]
    said = [e["message"] for e in swapped if e["type"] == "log" and "CPU optimizer's state" in e["message"]]
    assert said and "lives in swap files in the job's optimizer_swap/ folder" in said[0]
    assert not (tmp_path / "swap" / "optimizer_swap").exists()  # the engine removes its files at the end

    estimate = estimate_memory(spec_from(swapped_data, roots))
    assert estimate.host_limit_fits and estimate.optimizer_swap_bytes == last["optimizer_swap_bytes"]
    assert any("lives in swap files" in note for note in estimate.notes)


def test_a_job_with_its_optimizer_state_on_disk_resumes_from_a_checkpoint(tmp_path: Path, roots: PathRoots) -> None:
    data = limited(full_fine_tune(steps=6), roots)
    straight = run(data, roots, tmp_path / "straight")

    interrupted = merged(data, checkpoint={"every_steps": 3, "save_final": True})
    out = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="stopped"):
        run_job(spec_from(interrupted, roots), output_dir=out, report=stop_after(4))
    resumed = run(interrupted, roots, out)

    assert [e["step"] for e in steps_of(resumed)] == [4, 5, 6]
    assert [e["loss"] for e in steps_of(resumed)] == [e["loss"] for e in steps_of(straight)][3:]
    assert_same_weights(final_weights(tmp_path / "straight"), final_weights(out))


def stop_after(step: int) -> Any:
    def report(event: Any) -> None:
        if getattr(event, "type", None) == "step" and event.step == step:
            raise RuntimeError("stopped")

    return report


def test_a_swap_file_truncated_mid_job_fails_it_naming_the_file(tmp_path: Path, roots: PathRoots) -> None:
    data = limited(full_fine_tune(steps=6), roots)
    swap = tmp_path / "out" / "optimizer_swap"
    truncated: list[Path] = []

    def truncate_after_step_2(event: Any) -> None:
        if getattr(event, "type", None) == "step" and event.step == 2:
            victim = sorted(swap.iterdir())[len(truncated)]
            os.truncate(victim, victim.stat().st_size // 2)
            truncated.append(victim)

    events: list[dict[str, Any]] = []
    with pytest.raises(Exception, match="optimizer state swap file .* (changed on disk|was truncated)") as failed:
        run_job(spec_from(data, roots), output_dir=tmp_path / "out", report=lambda e: (
            events.append(event_to_wire(e)), truncate_after_step_2(e)))  # fmt: skip
    assert str(truncated[0]) in str(failed.value)
    assert [e["step"] for e in steps_of(events)][-1] <= 3  # stopped at the next update of that weight
    assert events[-1]["type"] == "failed" and str(truncated[0]) in events[-1]["message"]


def test_a_full_disk_while_writing_swap_fails_the_job_clearly(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = limited(full_fine_tune(steps=4), roots)
    real_pwrite = os.pwrite

    def full_after_step_1(fd: int, data: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".swap") and seen_steps:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    seen_steps: list[int] = []
    monkeypatch.setattr(os, "pwrite", full_after_step_1)
    events: list[dict[str, Any]] = []

    def report(event: Any) -> None:
        events.append(event_to_wire(event))
        if getattr(event, "type", None) == "step":
            seen_steps.append(event.step)

    with pytest.raises(Exception, match="No space left on device"):
        run_job(spec_from(data, roots), output_dir=tmp_path / "out", report=report)
    message = events[-1]["message"]
    assert events[-1]["type"] == "failed"
    assert "writing the CPU optimizer's state to swap file" in message and "optimizer_swap" in message
    assert "offload.host_memory_limit" in message


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is reset through Linux's /proc")
def test_peak_rss_stays_under_the_host_limit_with_the_optimizer_state_on_disk(tmp_path: Path, roots: PathRoots) -> None:
    """About 25M float32 weights (8 blocks of 512 wide): 100 MB of masters and 100 MB of gradients pinned, 200 MB
    of AdamW moments. The limit leaves the moments 32 MiB; the swap ring (3 slots of the largest weight's state:
    the 1 MiB x 2 moments of an MLP matrix) fits it. What is measured: the job process's peak resident set above
    its resident set after a warm-up run (test_disk_tier.py's helper)."""
    data = full_fine_tune(hidden=512, layers=8, steps=3)
    data["checkpoint"] = {"save_final": False}
    estimate = estimate_memory(spec_from(data, roots))
    state = estimate.optimizer_host_bytes
    limit = estimate.pinned_host_bytes + 32 * MIB
    in_ram = measured(data, roots, tmp_path / "ram")
    swapped = measured(merged(data, offload={**data["offload"], "host_memory_limit": limit}), roots, tmp_path / "swap")

    assert swapped["losses"] == in_ram["losses"]
    assert swapped["offload"]["optimizer_swap_bytes"] >= 0.99 * state
    assert in_ram["growth"] >= in_ram["pinned"] + 0.9 * state, in_ram  # the check means something
    beside = in_ram["growth"] - in_ram["pinned"] - in_ram["offload"]["optimizer_host_bytes"]  # activations etc.
    # 16 MiB for the swap's I/O threads' stacks and malloc arenas the all-RAM job has none of (test_disk_tier.py's
    # allowance): with 8, a CI run under load measured 296.4 MiB against a 294.6 MiB bound.
    assert swapped["growth"] <= limit + beside + 16 * MIB, (swapped, in_ram)
    assert in_ram["growth"] - swapped["growth"] >= 0.8 * (state - 32 * MIB), (swapped, in_ram)
    print(f"RSS growth: all in RAM {in_ram['growth'] / MIB:.0f} MiB, optimizer state on disk "
          f"{swapped['growth'] / MIB:.0f} MiB (limit {limit / MIB:.0f} MiB, state {state / MIB:.0f} MiB)")  # fmt: skip


def test_swap_files_on_a_filesystem_refusing_o_direct_go_through_the_page_cache_under_auto_and_fail_under_direct(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.offload.test_direct_io import refuse_o_direct

    data = limited(full_fine_tune(steps=3), roots)  # step 2's reads have finished when step 3 reports
    refuse_o_direct(monkeypatch)
    events = run(data, roots, tmp_path / "auto")
    said = [e["message"] for e in events if e["type"] == "log" and "offload.disk_io" in e["message"]]
    assert len(said) == 1 and "refuses O_DIRECT" in said[0] and "swap files go through the page cache" in said[0]
    assert steps_of(events)[-1]["offload"]["optimizer_swap_read_bytes"] > 0

    direct = merged(data, offload={**data["offload"], "disk_io": "direct"})
    failed: list[dict[str, Any]] = []
    with pytest.raises(Exception, match="offload.disk_io is 'direct'"):
        run_job(
            spec_from(direct, roots), output_dir=tmp_path / "direct", report=lambda e: failed.append(event_to_wire(e))
        )
    assert not steps_of(failed) and failed[-1]["type"] == "failed"
    assert "set offload.disk_io to 'auto'" in failed[-1]["message"] and "optimizer_swap" in failed[-1]["message"]


def test_direct_and_buffered_swap_files_train_the_same_job_bitwise(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    from offload.optimizer_swap import OptimizerSwap
    from tests.offload.test_direct_io import direct_reads_work

    if not direct_reads_work(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    opened_direct: list[bool] = []
    close = OptimizerSwap.close

    def close_noting_how(swap: OptimizerSwap) -> None:
        opened_direct.append(swap.direct)
        close(swap)

    monkeypatch.setattr(OptimizerSwap, "close", close_noting_how)
    data = limited(full_fine_tune(steps=3), roots)
    events = {}
    for mode in ("direct", "buffered"):
        events[mode] = run(merged(data, offload={**data["offload"], "disk_io": mode}), roots, tmp_path / mode)
    assert opened_direct == [True, False]
    assert [e["loss"] for e in steps_of(events["direct"])] == [e["loss"] for e in steps_of(events["buffered"])]
    assert_same_weights(final_weights(tmp_path / "direct"), final_weights(tmp_path / "buffered"))
    assert steps_of(events["direct"])[-1]["offload"]["optimizer_swap_read_bytes"] > 0
    assert not any("disk_io" in e.get("message", "") for e in events["direct"])  # no fallback said


def test_a_full_fine_tune_beyond_its_limit_even_with_the_state_swapped_is_refused_at_submit_with_its_figures(
    tmp_path: Path, roots: PathRoots
) -> None:
    import yaml

    from jobs.cli import machine_problems
    from jobs.fit.sizes import human_bytes
    from service.checking.check import check_spec
    from service.checking.messages import CheckRequest

    data = full_fine_tune()
    masters = estimate_memory(spec_from(data, roots)).pinned_host_bytes  # masters, gradients, buffers
    tight = merged(data, offload={**data["offload"], "host_memory_limit": masters // 2})
    spec = spec_from(tight, roots)
    estimate = estimate_memory(spec)
    assert not estimate.host_limit_fits and estimate.optimizer_swap_bytes > 0  # the state is swapped, still short
    assert 0 < estimate.trainable_host_bytes <= masters

    [(path, message)] = [(p.path, p.message) for p in machine_problems(spec, yaml.safe_dump(tight))]
    assert path == "offload.host_memory_limit"
    assert message.startswith(
        f"offload.host_memory_limit is {human_bytes(masters // 2)} but this full fine-tune needs an estimated "
        f"{human_bytes(estimate.engine_host_bytes)} of host memory even with its optimizer state swapped to disk: "
        f"the trainable weights' pinned host masters and their gradients {human_bytes(estimate.trainable_host_bytes)}"
        f" + the optimizer state's swap ring {human_bytes(estimate.optimizer_host_bytes)} (the state itself, "
        f"{human_bytes(estimate.optimizer_swap_bytes)}, already in swap files on disk)"
    )
    assert not any("every frozen weight fits in RAM" in note for note in estimate.notes)
    fixes = message.split("Fixes, in order: ")[1]
    assert fixes.startswith(f"raise offload.host_memory_limit to at least {human_bytes(estimate.engine_host_bytes)};")
    assert fixes.index("lora: section") < fixes.index("model.quantize: nf4") < fixes.index("a smaller model")

    refusal = check_spec(  # the service's submit check: a 422 with the same message
        CheckRequest(
            text=yaml.safe_dump(tight),
            model_roots=tuple(str(r) for r in roots.model_roots),
            data_roots=tuple(str(r) for r in roots.data_roots),
            max_yaml_depth=32,
            max_yaml_nodes=20_000,
        )
    ).refusal
    assert refusal is not None and (refusal.status_code, refusal.code) == (422, "does_not_fit")
    assert message in refusal.message and refusal.problems[0]["path"] == "offload.host_memory_limit"
