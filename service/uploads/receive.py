"""An upload's bytes, written to disk as they arrive and hashed as they pass, then moved into their place.

The place is ``<uploads>/<file id>/<name>``: a directory per file, so that the id alone names it under the
uploads directory (a data root) and the file keeps a suffix that tells its type (``.jsonl``).

Until it is complete an upload is a temporary file in ``Settings.incoming_uploads_dir``, outside every data
root: a spec cannot name it, and one left by a server killed mid-upload is removed at the next start
(``clean_incoming``). A disk that fills up during the write raises ``UploadNoSpace`` (a 507), not an OSError.

Example:
    writer = UploadWriter(settings.uploads_dir, settings.incoming_uploads_dir, limit=settings.max_upload_bytes)
    for chunk in chunks:
        writer.write(chunk)
    received = writer.commit("file-ab12", "train.jsonl")
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_NAME = 100
TEMPORARY_PREFIX = ".upload-"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
log = logging.getLogger("ferry.uploads")


class UploadTooLarge(Exception):
    """The upload passed its limit while it was being written."""


class UploadNoSpace(Exception):
    """The disk holding the uploads filled up while one was written; ``size`` is how much had been received."""

    def __init__(self, size: int) -> None:
        super().__init__(f"no space left after {size} bytes")
        self.size = size


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
    """A temporary file in ``incoming_dir`` that ``write`` appends to and hashes; ``commit`` moves it into
    ``<uploads>/<id>/<name>``, ``discard`` removes it. Past ``limit`` bytes ``write`` raises ``UploadTooLarge``;
    a full disk makes ``write`` or ``commit`` raise ``UploadNoSpace``."""

    def __init__(self, uploads_dir: Path, incoming_dir: Path, *, limit: int) -> None:
        uploads_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        incoming_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, dir=incoming_dir)  # mode 0600
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
        with self._no_space():
            self._file.write(chunk)

    def commit(self, file_id: str, name: str) -> Received:
        """Flush to disk and move into place; the record goes into the store after this."""
        with self._no_space():
            self._file.flush()
            os.fsync(self._file.fileno())  # the bytes are on disk before the store says the file exists
            self._file.close()
            directory = self.uploads_dir / file_id
            directory.mkdir(mode=0o700)
        path = directory / name
        os.replace(self._temporary, path)  # same disk (both under the storage directory): a rename
        return Received(path=path, size=self.size, sha256=self._hash.hexdigest())

    def discard(self) -> None:
        with suppress(OSError):
            self._file.close()  # flushes what is buffered: on a full disk that fails too
        self._temporary.unlink(missing_ok=True)

    @contextmanager
    def _no_space(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            if error.errno not in _NO_SPACE:
                raise
            raise UploadNoSpace(self.size) from error


def clean_incoming(uploads_dir: Path, incoming_dir: Path) -> None:
    """Remove the partial uploads a server killed mid-upload left (run at start-up, under the data directory's
    lock, so no upload is in flight); also those an older version left hidden in the uploads directory."""
    leftovers = [*incoming_dir.glob(f"{TEMPORARY_PREFIX}*"), *uploads_dir.glob(f"{TEMPORARY_PREFIX}*")]
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)
    if leftovers:
        log.info("removed %d partial uploads left by an earlier run", len(leftovers))


def remove_upload(uploads_dir: Path, file_id: str) -> None:
    """Remove an upload's directory (its bytes); nothing if it is gone already."""
    shutil.rmtree(uploads_dir / file_id, ignore_errors=True)
