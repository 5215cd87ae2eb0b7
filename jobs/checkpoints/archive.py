"""A whole checkpoint as one deterministic tar: the same checkpoint always packs to the same bytes.

The archive holds ``step-00000010/manifest.json`` first, then every file the manifest lists, in its order,
under the same top directory: PAX-format headers with owner 0, mode 0644 and the checkpoint's save time,
ending with two zero blocks padded to tar's 10240-byte record. Because the bytes depend only on the
checkpoint, its size is known before the first byte is sent and its SHA-256 is computed once and kept in
``exports/``.

Every file is opened when the archive is, so a checkpoint pruned (``checkpoint.keep_last``) or deleted
while it is being sent still arrives whole.

Example:
    >>> with open_archive(info) as archive:
    ...     digest = archive_sha256(archive, Path("out/exports"))
    ...     body = b"".join(archive.chunks())
    >>> hashlib.sha256(body).hexdigest() == digest
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from jobs.checkpoints.directory import CheckpointInfo
from jobs.checkpoints.manifest import MANIFEST

_BLOCK = tarfile.BLOCKSIZE  # 512
_RECORD = tarfile.RECORDSIZE  # 10240
_CHUNK = 1 << 20


class ArchiveMismatch(ValueError):
    """A checkpoint file's size on disk is not the one its manifest records."""


@dataclass
class _Member:
    header: bytes
    size: int
    handle: BinaryIO | None = None  # None for the manifest, whose bytes are in ``data``
    data: bytes = b""


@dataclass
class CheckpointArchive:
    """An opened checkpoint ready to stream as a tar (`chunks`); close it when done (a context manager).

    Attributes:
        filename: ``step-00000010.tar``.
        size: Bytes of the whole archive.
        manifest_sha256: SHA-256 of the manifest it packs: the key of its cached archive SHA-256.
    """

    filename: str
    size: int
    manifest_sha256: str
    members: list[_Member] = field(repr=False)

    def chunks(self) -> Iterator[bytes]:
        """The archive's bytes, a MiB at a time (files are read from their start, so it can run twice)."""
        for member in self.members:
            yield member.header
            if member.handle is None:
                yield member.data
            else:
                member.handle.seek(0)
                left = member.size
                while left:
                    chunk = member.handle.read(min(_CHUNK, left))
                    if not chunk:
                        raise ArchiveMismatch(f"{member.handle.name} is shorter than its manifest says")
                    left -= len(chunk)
                    yield chunk
            yield _padding(member.size)
        end = 2 * _BLOCK
        written = sum(len(m.header) + m.size + len(_padding(m.size)) for m in self.members) + end
        yield b"\0" * (end + (-written % _RECORD))

    def close(self) -> None:
        for member in self.members:
            if member.handle is not None:
                member.handle.close()

    def __enter__(self) -> CheckpointArchive:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def open_archive(info: CheckpointInfo) -> CheckpointArchive:
    """Open every file of ``info`` for packing.

    Raises:
        FileNotFoundError: A file the manifest lists is no longer on disk (the checkpoint was pruned).
        ArchiveMismatch: A file's size is not the manifest's.
    """
    directory = Path(info.path)
    manifest = (directory / MANIFEST).read_bytes()
    mtime = _mtime(info.created)
    members = [_Member(_header(f"{info.name}/{MANIFEST}", len(manifest), mtime), len(manifest), data=manifest)]
    try:
        for entry in info.files:
            header = _header(f"{info.name}/{entry['name']}", entry["bytes"], mtime)
            handle = (directory / entry["name"]).open("rb")
            members.append(_Member(header, entry["bytes"], handle=handle))
            if os.fstat(handle.fileno()).st_size != entry["bytes"]:
                raise ArchiveMismatch(f"{entry['name']} has not the {entry['bytes']} bytes its manifest records")
    except BaseException:
        for member in members:
            if member.handle is not None:
                member.handle.close()
        raise
    body = sum(len(m.header) + m.size + len(_padding(m.size)) for m in members) + 2 * _BLOCK
    return CheckpointArchive(
        filename=f"{info.name}.tar",
        size=body + (-body % _RECORD),
        manifest_sha256=hashlib.sha256(manifest).hexdigest(),
        members=members,
    )


def archive_sha256(archive: CheckpointArchive, cache_dir: Path) -> str:
    """The archive's SHA-256: read from ``cache_dir`` when this manifest's archive was hashed before, else
    computed by packing it once (every file read) and kept there."""
    cache = Path(cache_dir) / f"{archive.filename}.sha256.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("manifest_sha256") == archive.manifest_sha256 and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # none yet, or unreadable: compute it again
    digest = hashlib.sha256()
    for chunk in archive.chunks():
        digest.update(chunk)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"manifest_sha256": archive.manifest_sha256, "sha256": digest.hexdigest()}))
    os.replace(tmp, cache)  # atomic: a concurrent request reads the old entry or the new one
    return digest.hexdigest()


def _header(name: str, size: int, mtime: int) -> bytes:
    member = tarfile.TarInfo(name)
    member.size, member.mtime, member.mode = size, mtime, 0o644
    member.uid = member.gid = 0
    member.uname = member.gname = ""
    return member.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")


def _padding(size: int) -> bytes:
    return b"\0" * (-size % _BLOCK)


def _mtime(created: str) -> int:
    try:
        return int(datetime.fromisoformat(created).timestamp())
    except ValueError:
        return 0
