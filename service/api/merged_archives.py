"""A checkpoint's merged archive (``exports/step-00000010-merged.tar``) is made once, however many ask at once,
and always answers with its SHA-256.

A merge loads the whole base model into a process of its own, so two at once of the same checkpoint would
double the host memory for nothing. Requests in this process for a checkpoint being merged wait for that merge
and share its outcome (its archive, or its error); a lock file beside the archive (``flock``) makes a server's
other processes wait for it too, after which they find the archive made.

The checksum lives in ``<archive>.sha256``, written atomically after the archive. One missing, empty or not
a SHA-256 (a crash while hashing, a file deleted by hand) is computed again from the archive and rewritten.

Example:
    >>> digest = merged_archive_sha256(archive, merge=lambda: make(archive))
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from jobs.checkpoints.directory import file_sha256

_SHA256 = re.compile(r"[0-9a-f]{64}")
_flights: dict[Path, Future[str]] = {}  # archive -> the merge (or checksum) under way for it in this process
_flights_lock = threading.Lock()


def merged_archive_sha256(archive: Path, merge: Callable[[], None] | None = None) -> str:
    """The SHA-256 of ``archive``, made first by ``merge`` when it does not exist yet.

    Args:
        archive: The merged archive's path, under the job's ``exports/``.
        merge: Writes ``archive`` (atomically: it appears whole or not at all); None: only read or repair the
            checksum of an archive that exists.

    Returns:
        The archive's SHA-256, as hex.

    Raises:
        FileNotFoundError: ``merge`` is None and there is no archive.
        Whatever ``merge`` raises, in every request that waited for it.
    """
    digest = _recorded_sha256(archive)
    if digest is not None and archive.is_file():
        return digest
    with _flights_lock:
        flight = _flights.get(archive)
        leads = flight is None
        if flight is None:
            flight = _flights[archive] = Future()
    if not leads:
        return flight.result()  # the merge under way in this process: its archive, or its error
    try:
        digest = _under_file_lock(archive, merge)
    except BaseException as error:
        flight.set_exception(error)
        raise
    else:
        flight.set_result(digest)
        return digest
    finally:
        with _flights_lock:
            del _flights[archive]


def _under_file_lock(archive: Path, merge: Callable[[], None] | None) -> str:
    """Merge (when the archive is still missing) and checksum while holding the archive's lock file."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with archive.with_name(f".{archive.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process merges this checkpoint
        if archive.is_file():
            digest = _recorded_sha256(archive)
            return digest if digest is not None else _write_sha256(archive)
        if merge is None:
            raise FileNotFoundError(archive)
        merge()
        return _write_sha256(archive)  # never a checksum left by an archive of the same name before


def _sha256_file(archive: Path) -> Path:
    return archive.with_name(archive.name + ".sha256")


def _recorded_sha256(archive: Path) -> str | None:
    """The checksum on record, or None when it is missing, empty or not a SHA-256."""
    try:
        text = _sha256_file(archive).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return text if _SHA256.fullmatch(text) else None


def _write_sha256(archive: Path) -> str:
    """Hash the archive and record it: written to a temp file and renamed, so no reader sees it half-written."""
    digest = file_sha256(archive)
    target = _sha256_file(archive)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(digest)
    os.replace(tmp, target)
    return digest
