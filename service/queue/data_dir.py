"""The data directory: private to its owner (0700, files 0600) and served by one server at a time.

The lock: an exclusive ``flock`` held for the server's life, naming its holder's pid.

Two servers on one directory would each recover the other's "orphaned" running jobs (killing a healthy
one and running it twice) and both claim the queue. ``flock`` is released by the kernel when the holder
dies, however it dies, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "ferry.lock"


def make_private(data_dir: Path, storage_dir: Path) -> None:
    """Create the data (and shared storage) directory as 0700, and make what this process and its job
    processes create from now on private too (umask 077: files 0600, directories 0700).

    The database holds every spec and event; checkpoints hold the trained weights. Neither is for the
    machine's other users. The job directories inherit the protection of ``jobs/`` (0700).
    """
    os.umask(0o077)
    for directory in (data_dir, storage_dir, storage_dir / "jobs"):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
    for existing in data_dir.glob("ferry.sqlite3*"):
        existing.chmod(0o600)


class DataDirInUse(RuntimeError):
    """Another live process holds the data directory."""


class DataDirLock:
    """Hold ``<data_dir>/ferry.lock`` until ``release()``.

    Example:
        lock = DataDirLock.acquire(settings.data_dir)   # raises DataDirInUse, naming the other pid
        ...
        lock.release()
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        path = data_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirInUse(in_use_message(data_dir, holder_pid(data_dir))) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(fd, path)

    def release(self) -> None:
        os.close(self.fd)  # closing the descriptor drops the lock


def holder_pid(data_dir: Path) -> int | None:
    """The pid of the process holding the data directory, or None when none holds it."""
    path = data_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 32).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def in_use_message(data_dir: Path, pid: int | None) -> str:
    who = f"pid {pid}" if pid and pid > 0 else "another process"
    return (
        f"the data directory {data_dir.resolve()} is in use by another Ferry server ({who}); stop it first, "
        "or give this one its own FERRY_DATA_DIR"
    )
