"""Spare job processes: spawned ahead of their job with torch and ``jobs`` imported, one per slot.

Importing torch and ``jobs`` is most of a job process's start-up (seconds); a spare has done it before its
job is claimed, so the job's own start is the hand-over and the job's setup. A spare touches no device: it
knows its slot's ``CUDA_VISIBLE_DEVICES`` from the start, but CUDA is first initialised by the job itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from service.workers.executor.base import LaunchRequest
from service.workers.executor.child import run_spare

log = logging.getLogger("ferry.spares")

# CUDA does not survive fork(): every job gets a fresh interpreter.
SPAWN = mp.get_context("spawn")
# A slot's next spare starts this long after the last one was handed a job: its imports take seconds of CPU,
# which on a small machine would slow the start of the job just handed over.
SPARE_DELAY_S = 1.0
# A spare that dies before it has a job (an import error, the OOM killer) is replaced after a pause that
# doubles up to the last figure, so a spare that cannot start does not spawn on every scheduler tick.
RETRY_S = (1.0, 60.0)

SlotKey = tuple[str | None, int | None]  # (device, cpu_threads): what the process was prepared for


@dataclass
class Spare:
    """A spawned process importing or waiting, the pipe that hands it its job, and its stop flag."""

    key: SlotKey
    process: mp.process.BaseProcess
    conn: Connection
    stop_flag: Any
    ready_at: float | None = None  # wall-clock time its imports finished; None while it is importing

    @classmethod
    def start(cls, key: SlotKey) -> Spare:
        parent_end, child_end = SPAWN.Pipe(duplex=True)
        stop_flag = SPAWN.Value("i", 0, lock=False)  # one writer (us), one reader (the job)
        process = SPAWN.Process(
            target=run_spare, args=(*key, child_end, stop_flag), name=f"ferry-spare-{key[0] or 'cpu'}", daemon=False
        )
        process.start()
        child_end.close()  # the spare holds the only other end, so it sees EOF when we go away
        return cls(key, process, parent_end, stop_flag)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def poll_ready(self) -> bool:
        """True once the spare has reported its imports done (read without blocking)."""
        if self.ready_at is None:
            with contextlib.suppress(EOFError, OSError):
                if self.conn.poll():
                    self.ready_at = self.conn.recv()
        return self.ready_at is not None

    def take(self, request: LaunchRequest) -> bool:
        """Hand over the job; False if the spare has died meanwhile (the job then gets a fresh process)."""
        self.poll_ready()
        if self.process.exitcode is not None:
            return False
        try:
            self.conn.send(request)
        except OSError:
            return False
        self.conn.close()
        return True

    def discard(self) -> None:
        """It holds no job, so there is nothing to lose by killing it."""
        self.conn.close()
        self.process.kill()
        self.process.join()


@dataclass
class _Place:
    """One slot's place in the pool: its spare, and when the next one may start."""

    key: SlotKey
    spare: Spare | None = None
    not_before: float = 0.0
    retry_s: float = RETRY_S[0]


class SparePool:
    """One spare per slot (``keys`` holds a slot's key once per slot), replaced after each hand-over and
    whenever one dies.

    Example:
        pool = SparePool([("0", None), ("1", None)])   # a spare for GPU 0 and one for GPU 1
        spare = pool.take(("0", None))                 # then spare.take(request)
        pool.keep_warm()                               # on every scheduler tick: replaces the spare, later
    """

    def __init__(self, keys: list[SlotKey]) -> None:
        self._places = [_Place(key) for key in keys]
        self.keep_warm()

    def spares(self) -> list[Spare]:
        """The spares now, ready or importing."""
        return [place.spare for place in self._places if place.spare is not None]

    def take(self, key: SlotKey) -> Spare | None:
        """A spare for ``key`` (a ready one first), or None; its successor starts after SPARE_DELAY_S."""
        places = [place for place in self._places if place.key == key and place.spare is not None]
        if not places:
            return None
        place = max(places, key=lambda place: place.spare is not None and place.spare.poll_ready())
        spare, place.spare = place.spare, None
        place.not_before = time.monotonic() + SPARE_DELAY_S
        return spare

    def keep_warm(self) -> None:
        """Notice spares that are ready or dead, and start the missing ones that are due."""
        now = time.monotonic()
        for place in self._places:
            if place.spare is not None and place.spare.process.exitcode is not None:
                self._replace_dead(place, now)
            elif place.spare is not None and place.spare.ready_at is None and place.spare.poll_ready():
                place.retry_s = RETRY_S[0]
            if place.spare is None and now >= place.not_before:
                place.spare = Spare.start(place.key)

    def close(self) -> None:
        """End every spare (none holds a job)."""
        for place in self._places:
            if place.spare is not None:
                place.spare.discard()
                place.spare = None
        self._places = []

    @staticmethod
    def _replace_dead(place: _Place, now: float) -> None:
        spare = place.spare
        assert spare is not None
        log.warning(
            "the spare process for device %s (pid %s) died with exit code %s before it had a job; "
            "another starts in %.0f s",
            place.key[0] or "cpu", spare.pid, spare.process.exitcode, place.retry_s,
        )  # fmt: skip
        spare.discard()
        place.spare = None
        place.not_before = now + place.retry_s
        place.retry_s = min(RETRY_S[1], 2 * place.retry_s)
