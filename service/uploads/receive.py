"""An upload's bytes, written to disk as they arrive and hashed as they pass, then moved into their place.

The place is ``<uploads>/<file id>/<name>``: a directory per file, so that the id alone names it under the
uploads directory (a data root) and the file keeps a suffix that tells its type (``.jsonl``).

Example:
    writer = UploadWriter(settings.uploads_dir, limit=settings.max_upload_bytes)
    for chunk in chunks:
        writer.write(chunk)
    received = writer.commit("file-ab12", "train.jsonl")
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_NAME = 100


class UploadTooLarge(Exception):
    """The upload passed its limit while it was being written."""


@dataclass(frozen=True)
class Received:
    """A complete upload in its place."""

    path: Path  # <uploads>/<id>/<name>
    size: int
    sha256: str


def safe_name(filename: str | None, *, suffix: str | None = None) -> str:
    """``filename`` as a plain file name: its last path part, letters, digits, ``.``, ``_`` and ``-`` only, no
    leading dot, at most 100 characters; ending in ``suffix`` when one is asked for."""
    base = re.split(r"[/\\]", filename or "")[-1]
    name = _UNSAFE.sub("_", base).lstrip(".") or "upload"
    if suffix and not name.endswith(suffix):
        name += suffix
    if len(name) > MAX_NAME:
        stem, dot, ext = name.rpartition(".")
        name = stem[: MAX_NAME - len(ext) - 1] + dot + ext if dot and len(ext) < 16 else name[:MAX_NAME]
    return name


class UploadWriter:
    """A hidden temporary file in the uploads directory that ``write`` appends to and hashes; ``commit`` moves it
    into ``<uploads>/<id>/<name>``, ``discard`` removes it. Past ``limit`` bytes ``write`` raises ``UploadTooLarge``."""

    def __init__(self, uploads_dir: Path, *, limit: int) -> None:
        uploads_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(prefix=".upload-", dir=uploads_dir)  # mode 0600
        self.uploads_dir, self.limit = uploads_dir, limit
        self._file = os.fdopen(descriptor, "wb")
        self._temporary = Path(name)
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise UploadTooLarge
        self._hash.update(chunk)
        self._file.write(chunk)

    def commit(self, file_id: str, name: str) -> Received:
        """Flush to disk and move into place; the record goes into the store after this."""
        self._file.flush()
        os.fsync(self._file.fileno())  # the bytes are on disk before the store says the file exists
        self._file.close()
        directory = self.uploads_dir / file_id
        directory.mkdir(mode=0o700)
        path = directory / name
        os.replace(self._temporary, path)
        return Received(path=path, size=self.size, sha256=self._hash.hexdigest())

    def discard(self) -> None:
        self._file.close()
        self._temporary.unlink(missing_ok=True)


def remove_upload(uploads_dir: Path, file_id: str) -> None:
    """Remove an upload's directory (its bytes); nothing if it is gone already."""
    shutil.rmtree(uploads_dir / file_id, ignore_errors=True)
