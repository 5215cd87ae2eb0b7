"""run_job when a checkpoint goes wrong: a damaged newest manifest is passed over on resume (and said so), a
disk that fills while a checkpoint is written fails the job with ``disk_full`` and leaves no partial one, and a
save cut short by kill -9 leaves nothing behind once the job resumes."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import jobs.train.checkpoint_keeper
from jobs import list_checkpoints, run_job
from jobs.errors import DiskFullError
from jobs.events import event_to_wire
from tests.jobs.helpers import TOY, merged, spec_from

EVERY_2 = merged(TOY, checkpoint={"every_steps": 2})


class Killed(Exception):
    """Stands in for the process dying right after a checkpoint."""


def run(data: dict[str, Any], out: Path) -> tuple[Any, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    outcome = run_job(spec_from(data), output_dir=out, report=lambda e: events.append(event_to_wire(e)))
    return outcome, events


@pytest.mark.parametrize("manifest", ["{}", "[1, 2]", '{"step": "abc"}'])
def test_resume_passes_over_a_damaged_newest_manifest_for_the_newest_valid_checkpoint(
    tmp_path: Path, manifest: str
) -> None:
    def die_after_step_4(event: Any) -> None:
        if event.type == "checkpoint" and event.step == 4:
            raise Killed

    with pytest.raises(Killed):
        run_job(spec_from(EVERY_2), output_dir=tmp_path, report=die_after_step_4)
    (tmp_path / "checkpoints" / "step-00000004" / "manifest.json").write_text(manifest)

    outcome, events = run(EVERY_2, tmp_path)  # what every automatic retry does too
    assert outcome.status == "succeeded" and outcome.step == 10
    assert events[0]["type"] == "started" and events[0]["resumed_from_step"] == 2
    warnings = [e["message"] for e in events if e["type"] == "log" and e["level"] == "warning"]
    assert len(warnings) == 1
    assert warnings[0].startswith("checkpoint step-00000004 is not resumed from: manifest.json is damaged: ")


def test_a_disk_that_fills_during_a_checkpoint_fails_the_job_with_disk_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(directory: Path, **kwargs: Any) -> None:
        (directory / "training_state.pt").write_bytes(b"the first bytes")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jobs.train.checkpoint_keeper, "save_training_state", full_disk)
    events: list[dict[str, Any]] = []
    with pytest.raises(DiskFullError):
        run_job(spec_from(EVERY_2), output_dir=tmp_path, report=lambda e: events.append(event_to_wire(e)))
    failed = events[-1]
    assert (failed["type"], failed["error"], failed["exception"]) == ("failed", "disk_full", "DiskFullError")
    assert failed["message"].startswith(
        f"No space left on device: the disk holding {tmp_path / 'checkpoints'} filled while checkpoint "
        "step-00000002 was written; the partial checkpoint was removed."
    )
    assert list_checkpoints(tmp_path) == [] and list((tmp_path / "checkpoints").iterdir()) == []


def test_a_disk_that_fills_inside_the_safetensors_writer_fails_the_job_with_disk_full(small_disk: Path) -> None:
    """A real 2 MiB filesystem and about 4 MiB of weights: safetensors' writer raises its own error, not an
    OSError, and removes its partial file, so neither an errno nor the free space tells; its message does."""
    big = merged(EVERY_2, model={"hidden_size": 512, "num_layers": 4})
    events: list[dict[str, Any]] = []
    with pytest.raises(DiskFullError) as raised:
        run_job(spec_from(big), output_dir=small_disk, report=lambda e: events.append(event_to_wire(e)))
    assert type(raised.value.__cause__).__name__ == "SafetensorError"
    failed = events[-1]
    assert (failed["type"], failed["error"], failed["exception"]) == ("failed", "disk_full", "DiskFullError")
    assert failed["message"].startswith(
        f"No space left on device: the disk holding {small_disk / 'checkpoints'} filled while checkpoint "
        "step-00000002 was written; the partial checkpoint was removed."
    )
    assert list((small_disk / "checkpoints").iterdir()) == []


# A child process runs the job; its step-4 save writes part of training_state.pt, says so and waits to be killed.
KILLED_MID_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import jobs.train.checkpoint_keeper
    from jobs import run_job
    from tests.jobs.train.test_checkpoint_failures import EVERY_2
    from tests.jobs.helpers import spec_from

    save = jobs.train.checkpoint_keeper.save_training_state

    def hang_at_step_4(directory, **kwargs):
        if kwargs["step"] < 4:
            return save(directory, **kwargs)
        (directory / "training_state.pt").write_bytes(b"the first bytes")
        print("saving", flush=True)
        time.sleep(600)

    jobs.train.checkpoint_keeper.save_training_state = hang_at_step_4
    run_job(spec_from(EVERY_2), output_dir=Path(sys.argv[1]))
    """
)


def test_a_save_killed_midway_leaves_no_temp_checkpoint_once_the_job_resumes(tmp_path: Path) -> None:
    """kill -9 of the job's process in the middle of a save: the retry (resume) removes the half-written temp
    directory as it starts, lists only complete checkpoints, and the job's output ends as a finished run's."""
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[3],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])},
    )
    assert child.stdout is not None and child.stdout.readline() == "saving\n"
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left[0].startswith(".tmp-step-00000004-") and left[1:] == ["step-00000002"]

    outcome, events = run(EVERY_2, tmp_path)
    assert outcome.status == "succeeded" and events[0]["resumed_from_step"] == 2
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"step-{step:08d}" for step in (6, 8, 10)]  # checkpoint.keep_last's default: 3
    assert [c.name for c in list_checkpoints(tmp_path)] == names
