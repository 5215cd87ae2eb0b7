"""Checkpoint directories: written to a temp directory and renamed into place, with a SHA-256 manifest.

Layout: ``output_dir/checkpoints/step-00000010/`` holding ``manifest.json`` (step, spec, files with their
SHA-256), the trainable weights and ``training_state.pt``. A directory without a manifest, or whose files do
not match it, is never resumed from.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jobs.checkpoints.manifest import MANIFEST, ManifestError, read_manifest_file
from jobs.errors import DiskFullError

log = logging.getLogger(__name__)
_NEARLY_FULL_BYTES = 1 << 20  # under a MiB free after a failed write: the write failed for want of room
_FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# safetensors' Rust writer raises SafetensorError (no OSError, no errno) ending in Rust's "(os error 28)"; it
# removes its partial file first, so the disk is no longer full when the error arrives.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
EXPORTS_DIR = "exports"  # beside checkpoints/: merged models and other exports (jobs/checkpoints/export.py)


ADAPTER_CONFIG = "adapter_config.json"
MERGEABLE_MODEL_KINDS = frozenset({"hf_causal_lm"})  # peft's merge_and_unload into an AutoModelForCausalLM


def is_mergeable(file_names: Iterable[str], model_kind: str | None) -> bool:
    """Whether a checkpoint can be merged into a full model: a LoRA adapter (``adapter_config.json``) of a
    family whose base loads as a Hugging Face model. The merge itself (``jobs.checkpoints.export``) refuses
    the rest, and the API marks each checkpoint with this, so the dashboard offers Merge only where it works."""
    return model_kind in MERGEABLE_MODEL_KINDS and ADAPTER_CONFIG in set(file_names)


@dataclass(frozen=True)
class CheckpointInfo:
    """A saved checkpoint as its manifest describes it.

    Attributes:
        name: Directory name, ``step-00000010``.
        step: Optimizer steps completed when it was saved.
        path: Absolute path of the directory.
        created: ISO-8601 UTC time of saving.
        files: ``[{name, bytes, sha256}]`` for every file except the manifest.
        eval_loss: The eval loss measured at this step, when the job evaluates.
    """

    name: str
    step: int
    path: str
    created: str
    files: list[dict[str, Any]] = field(default_factory=list)
    eval_loss: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A checkpoint directory whose manifest cannot be used: never resumed from, listed with why.

    Attributes:
        name: Directory name, ``step-00000010``.
        path: Absolute path of the directory.
        reason: What is wrong with its manifest.
    """

    name: str
    path: str
    reason: str

    @property
    def step(self) -> int | None:
        """The step its name gives (the manifest's own cannot be trusted), or None."""
        digits = self.name.removeprefix("step-")
        return int(digits) if digits.isdigit() else None


@dataclass(frozen=True)
class CheckpointScan:
    """Every checkpoint directory of a job: the usable ones and the damaged ones, each oldest first."""

    valid: list[CheckpointInfo]
    damaged: list[DamagedCheckpoint]


def checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(
    output_dir: Path,
    step: int,
    spec: dict[str, Any],
    write: Callable[[Path], None],
    *,
    keep_last: int | None = None,
    eval_loss: float | None = None,
) -> CheckpointInfo:
    """Save a checkpoint atomically and prune old ones.

    Args:
        output_dir: The job's output directory.
        step: Optimizer steps completed.
        spec: The resolved job spec (JSON-able), stored in the manifest.
        write: Writes the checkpoint's files into the directory it is given.
        keep_last: Keep only this many newest checkpoints (None keeps all), and the best one.
        eval_loss: The eval loss at this step, recorded so the best checkpoint can be found and kept.

    Returns:
        The new checkpoint.
    """
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{checkpoint_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        # Files in subfolders too (a full fine-tune's transformer/), named by their relative path.
        files = [_describe(p, tmp) for p in sorted(tmp.rglob("*")) if p.is_file()]
        created = datetime.now(UTC).isoformat(timespec="seconds")
        manifest = {"step": step, "created": created, "spec": spec, "files": files, "eval_loss": eval_loss}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        for path in tmp.rglob("*"):
            _fsync(path)
        final = root / checkpoint_name(step)
        _replace_dir(tmp, final)
    except BaseException as error:
        full = _disk_is_full(error, root)  # asked before the partial files are removed and free the disk
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(
                f"No space left on device: the disk holding {root} filled while checkpoint "
                f"{checkpoint_name(step)} was written; the partial checkpoint was removed. Free space on that disk "
                "(delete finished jobs: DELETE /v1/jobs/<id>) or keep fewer checkpoints (checkpoint.keep_last), "
                "then resume the job."
            ) from error
        raise
    _fsync(root)
    if keep_last is not None:
        prune_checkpoints(output_dir, keep_last)
    return CheckpointInfo(final.name, step, str(final), created, files, eval_loss)


def list_checkpoints(output_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints under ``output_dir`` with a valid manifest, oldest first (files are not re-hashed;
    see `verify`)."""
    return scan_checkpoints(output_dir).valid


def scan_checkpoints(output_dir: Path) -> CheckpointScan:
    """Every ``step-*`` directory under ``output_dir`` with a manifest: usable, or damaged and why.

    A directory without a manifest is left out: an interrupted foreign copy, or one being pruned.
    """
    root = checkpoints_dir(output_dir)
    valid, damaged = [], []
    for directory in sorted(root.glob("step-*")) if root.is_dir() else []:
        try:
            manifest = read_manifest_file(directory)
        except FileNotFoundError:
            continue
        except (ManifestError, NotADirectoryError) as error:
            damaged.append(DamagedCheckpoint(directory.name, str(directory.resolve()), str(error)))
            continue
        files = [entry.model_dump() for entry in manifest.files]
        valid.append(
            CheckpointInfo(
                directory.name, manifest.step, str(directory.resolve()), manifest.created, files, manifest.eval_loss
            )
        )
    return CheckpointScan(sorted(valid, key=lambda info: info.step), damaged)


def read_manifest(info: CheckpointInfo) -> dict[str, Any]:
    return read_manifest_file(Path(info.path)).model_dump()


def verify(info: CheckpointInfo) -> bool:
    """True when every file exists with the size and SHA-256 its manifest records."""
    for entry in info.files:
        path = Path(info.path) / entry["name"]
        if not path.is_file() or path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            return False
    return True


def latest_valid_checkpoint(output_dir: Path) -> CheckpointInfo | None:
    """The newest checkpoint whose files match its manifest; damaged ones are skipped with a warning."""
    return resume_point(output_dir)[0]


def resume_point(output_dir: Path) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest checkpoint to resume from, and why each newer one was passed over (for the job's log).

    A damaged manifest or a file that does not match it never stops a resume while an older checkpoint
    is intact.
    """
    scan = scan_checkpoints(output_dir)
    candidates: list[CheckpointInfo | DamagedCheckpoint] = [*scan.valid, *scan.damaged]
    candidates.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    skipped: list[str] = []
    for candidate in reversed(candidates):
        if isinstance(candidate, CheckpointInfo) and verify(candidate):
            return candidate, skipped
        why = candidate.reason if isinstance(candidate, DamagedCheckpoint) else "its files do not match its manifest"
        skipped.append(f"checkpoint {candidate.name} is not resumed from: {why}")
        log.warning("%s (%s)", skipped[-1], candidate.path)
    return None, skipped


def best_checkpoint(checkpoints: list[CheckpointInfo]) -> CheckpointInfo | None:
    """The checkpoint with the lowest eval loss (the earliest among equals); None when none was evaluated."""
    evaluated = [c for c in checkpoints if c.eval_loss is not None]
    return min(evaluated, key=lambda c: (c.eval_loss, c.step)) if evaluated else None


def prune_checkpoints(output_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints and the best one, and leftovers of interrupted saves."""
    checkpoints = list_checkpoints(output_dir)
    best = best_checkpoint(checkpoints)
    for info in checkpoints[:-keep_last]:
        if best is None or info.name != best.name:
            shutil.rmtree(info.path, ignore_errors=True)
    for leftover in checkpoints_dir(output_dir).glob(".tmp-*"):
        if leftover.is_dir() and not _written_by_live_save(leftover):
            shutil.rmtree(leftover, ignore_errors=True)


def remove_interrupted_saves(output_dir: Path) -> list[str]:
    """Delete every temp directory of a save that never finished (``.tmp-step-*``, ``.tmp-old-*``); returns
    their names.

    Call it as an attempt starts, before it saves: the attempt that wrote them is gone (killed mid-save), so
    none belongs to a live save, however recent. Left there they would stay in the job's output for good.
    """
    root = checkpoints_dir(output_dir)
    removed = []
    for leftover in sorted(root.glob(".tmp-*")) if root.is_dir() else []:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover.name)
    return removed


def _written_by_live_save(directory: Path) -> bool:
    # A temp dir modified in the last minute may belong to a save in progress in another process.
    return (datetime.now().timestamp() - directory.stat().st_mtime) < 60


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` (a re-save of the same step) is swapped out first."""
    if dst.exists():
        trash = dst.with_name(f".tmp-old-{dst.name}-{uuid.uuid4().hex[:8]}")
        os.rename(dst, trash)
        os.rename(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(src, dst)  # atomic on POSIX: readers see no directory or a complete one


def _disk_is_full(error: BaseException, root: Path) -> bool:
    """Whether a failed save ran out of disk: an ``OSError`` with ENOSPC or EDQUOT, or safetensors' error naming
    either as Rust does (``(os error 28)``). torch's writer reports a full disk as a ``RuntimeError``
    (``unexpected pos``, ``file write failed``) that keeps no errno, so the disk's free space decides then."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_DISK_ERRNOS:
            return True
        if any(int(code) in _FULL_DISK_ERRNOS for code in _RUST_OS_ERROR.findall(str(seen))):
            return True
        seen = seen.__cause__ or seen.__context__
    if not isinstance(error, (OSError, RuntimeError)):
        return False
    try:
        return shutil.disk_usage(root).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _describe(path: Path, root: Path) -> dict[str, Any]:
    return {"name": path.relative_to(root).as_posix(), "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks (checkpoints, cache shards and merged archives)."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def files_identity(path: Path, *, modification_times: bool = False) -> str:
    """SHA-256 over a model folder's files (or one file): a config file's (``.json``) name and bytes, any other
    file's name and size, and with ``modification_times`` its modification time too. Not the weights' bytes:
    hashing tens of GB per job would take minutes. A file written again with the same size (a fine-tune saved
    over the same path) changes only its modification time."""
    digest = hashlib.sha256()
    for file in sorted(path.glob("*")) if path.is_dir() else [path]:
        if not file.is_file():
            continue
        if file.suffix == ".json":
            digest.update(file.name.encode() + file.read_bytes())
        else:
            stat = file.stat()
            stamp = f":{stat.st_mtime_ns}" if modification_times else ""
            digest.update(f"{file.name}:{stat.st_size}{stamp}".encode())
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
