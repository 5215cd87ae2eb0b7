"""Disk pressure: how much room the data directory's disk has, a refusal to take new work when it is low,
and a reserve that lets cancel and delete free space on a disk that is already full.

SQLite needs a few pages free even to delete rows (the write-ahead log grows first), so on a full disk
the very requests that would free space failed. A small file set aside at start-up is given back the
moment such a write fails, and the write is retried once.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from jobs.fit.sizes import human_bytes
from service.errors import ApiError

log = logging.getLogger("ferry.disk")
RESERVE_NAME = "ferry.reserve"
RESERVE_BYTES = 8 << 20  # a delete of a job with its events needs a few MiB of log
T = TypeVar("T")


def free_bytes(path: Path) -> int:
    """Free bytes on the disk holding ``path``."""
    return shutil.disk_usage(path).free


def low_disk_message(data_dir: Path, min_free: int) -> str | None:
    """Why the disk is too full for new work, or None while it is not."""
    free = free_bytes(data_dir)
    if free >= min_free:
        return None
    return (
        f"the disk holding {data_dir.resolve()} has {human_bytes(free)} free, under FERRY_MIN_FREE_DISK_BYTES "
        f"({human_bytes(min_free)}); delete finished jobs (DELETE /v1/jobs/<id>) or free space on that disk"
    )


def refuse_if_disk_low(data_dir: Path, min_free: int) -> None:
    """Raise 507 ``insufficient_storage`` when new work would run the disk full."""
    message = low_disk_message(data_dir, min_free)
    if message is not None:
        raise ApiError(507, "insufficient_storage", f"The service is short of disk space: {message}.")


def ensure_reserve(data_dir: Path) -> None:
    """Set ``RESERVE_BYTES`` aside (really allocated, not a sparse file) while there is room for it."""
    path = data_dir / RESERVE_NAME
    if path.exists() or free_bytes(data_dir) < 4 * RESERVE_BYTES:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
    except OSError:
        os.unlink(path)
    finally:
        os.close(fd)


def with_space_to_free(data_dir: Path, write: Callable[[], T]) -> T:
    """Run ``write`` (a cancel, a delete); should the disk be full, give back the reserve and run it again."""
    try:
        return write()
    except sqlite3.OperationalError as error:
        reserve = data_dir / RESERVE_NAME
        if "full" not in str(error) or not reserve.exists():
            raise
        log.warning("the disk is full; giving back the %s reserve so that the request can free space", RESERVE_NAME)
        reserve.unlink()
        return write()
