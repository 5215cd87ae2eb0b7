"""Checkpoint directories: atomic, hashed, pruned; damaged ones are never resumed from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from jobs.checkpoints.directory import latest_valid_checkpoint, list_checkpoints, save_checkpoint, verify


def write_files(content: bytes) -> callable:
    def write(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(content)
        (directory / "training_state.pt").write_bytes(content[::-1])

    return write


def test_save_writes_manifest_with_hashes(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path, 10, {"name": "job"}, write_files(b"weights"))
    assert info.name == "step-00000010" and info.step == 10
    assert Path(info.path) == tmp_path / "checkpoints" / "step-00000010"
    manifest = json.loads((Path(info.path) / "manifest.json").read_text())
    assert manifest["step"] == 10 and manifest["spec"] == {"name": "job"}
    assert manifest["files"] == info.files
    entry = next(f for f in info.files if f["name"] == "model.safetensors")
    assert entry == {"name": "model.safetensors", "bytes": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}
    assert verify(info)


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    def fail(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 5, {}, fail)
    assert list_checkpoints(tmp_path) == []
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_keep_last_prunes_oldest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {}, write_files(bytes([step])), keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]


def test_resave_of_the_same_step_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 3, {}, write_files(b"old"))
    info = save_checkpoint(tmp_path, 3, {}, write_files(b"new"))
    assert (Path(info.path) / "model.safetensors").read_bytes() == b"new"
    assert [c.step for c in list_checkpoints(tmp_path)] == [3]


def test_damaged_and_incomplete_checkpoints_are_skipped(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, {}, write_files(b"good"))
    newest = save_checkpoint(tmp_path, 2, {}, write_files(b"good too"))
    (Path(newest.path) / "model.safetensors").write_bytes(b"bit rot!")
    (tmp_path / "checkpoints" / "step-00000003").mkdir()  # no manifest: an interrupted foreign copy
    (tmp_path / "checkpoints" / ".tmp-step-00000004-abcd").mkdir()
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]
    assert not verify(newest)
    assert latest_valid_checkpoint(tmp_path).step == 1


def test_no_checkpoints(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path) == [] and latest_valid_checkpoint(tmp_path) is None
