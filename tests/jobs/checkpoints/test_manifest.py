"""A manifest of the wrong shape marks its checkpoint damaged, with why, and never breaks the others; resume
falls back to the newest intact checkpoint; a disk that fills during a save leaves nothing and says so."""

from __future__ import annotations

import errno
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from jobs.checkpoints.directory import (
    latest_valid_checkpoint,
    list_checkpoints,
    resume_point,
    save_checkpoint,
    scan_checkpoints,
)
from jobs.errors import DiskFullError
from jobs.events import ErrorCode, failed_event
from tests.jobs.checkpoints.test_checkpoint import write_files


@pytest.mark.parametrize(
    ("manifest", "why"),
    [
        ("{}", "manifest.json is damaged: step: Field required; created: Field required; files: Field required"),
        (
            "[1, 2]",
            "manifest.json is damaged: the top level: Input should be a valid dictionary or instance of Manifest",
        ),
        (
            '{"step": "abc", "created": "x", "files": []}',
            "manifest.json is damaged: step: Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            "{not json",
            "manifest.json is damaged: not JSON (Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1))",
        ),
        (
            '{"step": 3, "created": "x", "files": [{"name": "../../etc/passwd", "bytes": 1, "sha256": "'
            + "0" * 64
            + '"}]}',
            "manifest.json is damaged: files.0.name: Value error, '../../etc/passwd' is not a path inside the "
            "checkpoint directory",
        ),
    ],
)
def test_a_manifest_of_the_wrong_shape_marks_only_its_checkpoint_damaged(
    tmp_path: Path, manifest: str, why: str
) -> None:
    save_checkpoint(tmp_path, 1, {}, write_files(b"good"))
    newest = save_checkpoint(tmp_path, 2, {}, write_files(b"good too"))
    (Path(newest.path) / "manifest.json").write_text(manifest)
    scan = scan_checkpoints(tmp_path)
    assert [c.step for c in scan.valid] == [1]
    assert [(d.name, d.step, d.reason) for d in scan.damaged] == [("step-00000002", 2, why)]
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]


def test_resume_passes_over_a_damaged_newest_checkpoint_and_says_why(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, {}, write_files(b"one"))
    rotten = save_checkpoint(tmp_path, 2, {}, write_files(b"two"))
    broken = save_checkpoint(tmp_path, 3, {}, write_files(b"three"))
    (Path(rotten.path) / "model.safetensors").write_bytes(b"bit rot")
    (Path(broken.path) / "manifest.json").write_text("{}")
    found, passed_over = resume_point(tmp_path)
    assert found is not None and found.step == 1
    assert passed_over == [
        "checkpoint step-00000003 is not resumed from: manifest.json is damaged: step: Field required; "
        "created: Field required; files: Field required",
        "checkpoint step-00000002 is not resumed from: its files do not match its manifest",
    ]
    assert latest_valid_checkpoint(tmp_path) == found


def test_a_disk_that_fills_during_a_save_leaves_no_partial_checkpoint_and_names_the_directory(
    tmp_path: Path,
) -> None:
    def fill(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"half of it")
        raise OSError(errno.ENOSPC, "No space left on device")

    save_checkpoint(tmp_path, 1, {}, write_files(b"one"))
    with pytest.raises(DiskFullError) as raised:
        save_checkpoint(tmp_path, 2, {}, fill)
    root = tmp_path / "checkpoints"
    assert str(raised.value).startswith(
        f"No space left on device: the disk holding {root} filled while checkpoint step-00000002 was written; "
        "the partial checkpoint was removed."
    )
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    event = failed_event(raised.value)
    assert event.error == ErrorCode.DISK_FULL and event.exception == "DiskFullError"


def test_torchs_unexpected_pos_on_a_full_disk_is_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save on a full disk raises a RuntimeError without errno; the disk's free space tells."""

    def torch_on_a_full_disk(directory: Path) -> None:
        (directory / "training_state.pt").write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 20, 100 << 20, 4096))
    with pytest.raises(DiskFullError, match="No space left on device") as raised:
        save_checkpoint(tmp_path, 5, {}, torch_on_a_full_disk)
    assert "unexpected pos" in str(raised.value.__cause__)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_another_failure_with_room_on_the_disk_stays_what_it_was(tmp_path: Path) -> None:
    def fail(directory: Path) -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="^a bug$"):
        save_checkpoint(tmp_path, 5, {}, fail)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_manifest_with_extra_keys_from_a_newer_writer_is_not_damage(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path, 4, {}, write_files(b"w"))
    manifest = json.loads((Path(info.path) / "manifest.json").read_text())
    (Path(info.path) / "manifest.json").write_text(json.dumps({**manifest, "format": 2}))
    assert list_checkpoints(tmp_path) == [info]
