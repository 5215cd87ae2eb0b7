"""A checkpoint packs to one deterministic tar whose SHA-256 is known before it is sent, and which a file
deleted mid-download cannot break."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from jobs.checkpoints.archive import archive_sha256, open_archive
from jobs.checkpoints.directory import save_checkpoint


def write_nested(directory: Path) -> None:
    (directory / "transformer").mkdir()
    (directory / "transformer" / "model.safetensors").write_bytes(os.urandom(3000))
    (directory / "training_state.pt").write_bytes(b"state")


def test_the_archive_holds_the_manifest_and_every_file_with_the_announced_size_and_digest(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path, 7, {"name": "job"}, write_nested)
    with open_archive(info) as archive:
        digest = archive_sha256(archive, tmp_path / "exports")
        body = b"".join(archive.chunks())
        again = b"".join(archive.chunks())
    assert archive.filename == "step-00000007.tar"
    assert len(body) == archive.size and body == again and len(body) % tarfile.RECORDSIZE == 0
    assert hashlib.sha256(body).hexdigest() == digest
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert tar.getnames() == [
            "step-00000007/manifest.json",
            "step-00000007/training_state.pt",
            "step-00000007/transformer/model.safetensors",
        ]
        for entry in info.files:
            member = tar.extractfile(f"step-00000007/{entry['name']}")
            assert member is not None and hashlib.sha256(member.read()).hexdigest() == entry["sha256"]
    # Kept for the next request, keyed by the manifest.
    assert (tmp_path / "exports" / "step-00000007.tar.sha256.json").is_file()
    with open_archive(info) as archive:
        assert archive_sha256(archive, tmp_path / "exports") == digest


def test_files_removed_after_the_archive_opened_still_arrive(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path, 1, {}, write_nested)
    with open_archive(info) as archive:
        digest = archive_sha256(archive, tmp_path / "exports")
        for entry in info.files:
            (Path(info.path) / entry["name"]).unlink()  # keep_last pruned it mid-download
        assert hashlib.sha256(b"".join(archive.chunks())).hexdigest() == digest


def test_a_file_already_gone_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path, 1, {}, write_nested)
    (Path(info.path) / "training_state.pt").unlink()
    with pytest.raises(FileNotFoundError):
        open_archive(info)
