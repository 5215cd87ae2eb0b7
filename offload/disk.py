"""The disk tier: frozen weights read from their checkpoint files on each use instead of held in host memory.

When host memory cannot hold every frozen weight (a 70B bf16 model is 131 GiB), the units the plan puts on
disk (plan.py, ``OffloadOptions.host_memory_limit``) have no host copy. Their bytes stay where they already
are, in the checkpoint's own files, and each visit reads them with plain ``os.preadv`` calls (``O_DIRECT``
where the filesystem allows, past the page cache: direct_io.py, ``OffloadOptions.disk_io``) into a small
pinned *staging ring* (a few slots of the largest disk unit), from which the ordinary host-to-device copy
into the device ring runs. Host memory then holds the staging ring plus the units kept in RAM.

Reads run ahead on a thread. The order is learned, not guessed: the step after the schedule is fixed
(``DiskStage.record_next_step``) records the order in which units actually asked for their bytes (so units
whose device slot still held them at a turnaround, which read nothing, are not in it), and from then on each
unit taken starts the reads of the ones after it in that cycle while slots are free. A unit asked for out of
that order (a different batch shape, a module called twice) drops the reads queued ahead of it, or reads at
once if none was for it: slower, never wrong.

Between uses each disk weight is a view of a read-only, private memory map of its file (``torch.from_file``),
so code reading it outside its unit's forward (``state_dict``, ``remove(copy=False)``) sees its true values;
those pages are the file's, not the process's, until touched. The engine itself never reads through the map.

A checkpoint file that changes while the job streams from it (truncated, rewritten, replaced) must fail the
job rather than train on other weights: every read checks the file's size, modification time and inode
against what they were when the tier opened it, before and after reading, and a short read is an error;
each names the file (`CheckpointChanged`). A rewrite that keeps size, inode and nanosecond mtime is not seen.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.direct_io import ALIGNMENT, align_up, aligned_empty, open_weights, read_direct

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 16 << 20  # one preadv; a unit's reads are split so that several threads share a large one
# One O_DIRECT read: each reader thread holds a bounce buffer of this size (plus two blocks), host memory the
# plan counts with the staging ring (`bounce_bytes`), so it is kept small; the threads keep several in flight.
DIRECT_CHUNK_BYTES = 1 << 20
READ_THREADS = 4  # parallel reads within one unit


def direct_chunk_bytes(slot_bytes: int, threads: int = READ_THREADS) -> int:
    """One O_DIRECT read of a stage whose slots hold ``slot_bytes``: a slot's share of a reader thread at most,
    so that the bounce buffers of a small model's stage do not outweigh its ring."""
    return min(DIRECT_CHUNK_BYTES, align_up(-(-max(slot_bytes, 1) // threads)))


def bounce_bytes(disk_io: str, slot_bytes: int, threads: int = READ_THREADS) -> int:
    """The host memory O_DIRECT reads take beside the staging ring: one aligned bounce buffer per reader thread
    (and one for the caller's ``read_copy``); none for buffered reads."""
    if disk_io == "buffered" or not slot_bytes:
        return 0
    return (threads + 1) * (direct_chunk_bytes(slot_bytes, threads) + 2 * ALIGNMENT)


@dataclass(frozen=True)
class FileRange:
    """Where a frozen tensor's exact bytes lie: ``[start, end)`` of ``path`` (its dtype and shape are the
    tensor's; whoever gives a range vouches that the bytes are what the engine would otherwise hold)."""

    path: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


DiskLocator = Callable[[str, torch.Tensor], FileRange | None]  # (name, tensor) -> its bytes on disk, or None


class CheckpointChanged(RuntimeError):
    """A weights file the disk tier streams from changed on disk after the job opened it."""


class _OpenFile:
    """One checkpoint file, opened once (``O_DIRECT`` where ``disk_io`` asks and the filesystem allows), with
    what it looked like then (size, mtime, inode)."""

    def __init__(self, path: Path, disk_io: str) -> None:
        self.path = path
        self.fd, self.fallback = open_weights(path, disk_io)  # fallback: why auto reads through the page cache
        self.direct = disk_io != "buffered" and self.fallback is None
        self.identity = _identity(os.fstat(self.fd))
        self._map: torch.Tensor | None = None

    def check(self, stat: os.stat_result | None = None) -> None:
        """Raise `CheckpointChanged` if the file is no longer what it was when opened."""
        now = _identity(stat if stat is not None else _stat_or_none(self.path))
        if now != self.identity:
            size, mtime, inode = self.identity
            raise CheckpointChanged(
                f"model weights file {self.path} changed on disk while the job streams frozen weights from it "
                f"(size {size} -> {now[0]}, mtime_ns {mtime} -> {now[1]}, inode {inode} -> {now[2]}); restore the "
                "file and resume the job, or unset offload.host_memory_limit to hold the weights in memory"
            )

    def mapped(self) -> torch.Tensor:
        """The whole file as a private read-only map (pages come from the file when touched)."""
        if self._map is None:
            self._map = torch.from_file(str(self.path), shared=False, size=self.identity[0], dtype=torch.uint8)
        return self._map

    def close(self) -> None:
        os.close(self.fd)


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` for asynchronous copies; False (with a warning) where that fails."""
    if not torch.cuda.is_available():
        return False
    code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if int(code) != 0:
        log.warning(
            "cudaHostRegister of the %d-byte staging ring failed (%s); its copies are synchronous", buffer.numel(), code
        )
        return False
    return True


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _identity(stat: os.stat_result | None) -> tuple[int, int, int]:
    return (-1, -1, -1) if stat is None else (stat.st_size, stat.st_mtime_ns, stat.st_ino)


class DiskSpan:
    """The disk part of one unit: its frozen weights' file ranges and where each lands in the unit's span
    (the same offsets its device slot uses, flat.py)."""

    def __init__(self, name: str, pieces: list[tuple[int, FileRange]], nbytes: int) -> None:
        self.name = name
        self.pieces = pieces  # (offset in the span, the bytes on disk)
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"DiskSpan({self.name!r}, {len(self.pieces)} tensors, {self.nbytes} bytes)"


class _Entry:
    """One read into a staging slot: issued ahead (or on demand), taken by its unit's copy, then released."""

    __slots__ = ("future", "slot", "span")

    def __init__(self, span: DiskSpan, slot: int, future: Future[float]) -> None:
        self.span, self.slot, self.future = span, slot, future


class DiskStage:
    """The staging ring and its reads: ``slots`` pinned buffers of ``slot_bytes``, filled on a thread.

    Args:
        files: every file a disk unit reads from.
        slots: staging slots (the unit being copied plus those read ahead).
        slot_bytes: the largest disk unit's span.
        pin: page-lock the staging ring (asynchronous host-to-device copies from it).
        device: the target device (on CUDA a slot is reused only after the copy that read it has run).
        threads: parallel reads within one unit.
        disk_io: ``auto`` (``O_DIRECT`` where the filesystem allows, else through the page cache), ``direct``
            (``O_DIRECT`` or `DirectIOUnsupported`) or ``buffered`` (through the page cache).
    """

    def __init__(
        self,
        files: list[Path],
        *,
        slots: int,
        slot_bytes: int,
        pin: bool,
        device: torch.device,
        threads: int = READ_THREADS,
        disk_io: str = "auto",
    ) -> None:
        self.files: dict[Path, _OpenFile] = {}
        try:
            for path in dict.fromkeys(files):
                self.files[path] = _OpenFile(path, disk_io)
        except BaseException:
            for handle in self.files.values():
                handle.close()
            raise
        # Why disk_io: auto reads through the page cache (said once, in the job's events), None where it need not.
        self.fallback = next((h.fallback for h in self.files.values() if h.fallback), None)
        if self.fallback:
            log.info("offload.disk_io auto: %s; the disk tier reads through the page cache", self.fallback)
        self._bounces = threading.local()  # each reader thread's aligned buffer for O_DIRECT reads
        # Slots on O_DIRECT's block boundaries (torch's allocator promises 64 bytes, hence aligned_empty).
        self.stride = align_up(max(slot_bytes, 1))
        direct = any(handle.direct for handle in self.files.values())
        self._chunk = direct_chunk_bytes(slot_bytes, max(1, threads))
        self.nbytes = slots * self.stride + (bounce_bytes("direct", slot_bytes, max(1, threads)) if direct else 0)
        self.buffer = aligned_empty(max(slots * self.stride, 1))
        # Page-locked in place (cudaHostRegister), not through torch's pinned allocator, which rounds a request
        # up to a power of two: three 1 GB slots would take 4 GiB of the host limit instead of 3.
        self._registered = pin and _register(self.buffer)
        self.device = device
        self._slot_events: list[torch.cuda.Event | None] = [None] * slots  # the last copy out of each slot
        self._free: deque[int] = deque(range(slots))
        self._queue: deque[_Entry] = deque()  # issued, not yet taken, in cycle order
        self._current: _Entry | None = None  # taken, its copy not yet queued
        self._cycle: list[DiskSpan] = []
        self._position: dict[int, int] = {}  # id(span) -> its place in the cycle
        self._cursor = 0  # the next place in the cycle to read ahead
        self._recording: list[DiskSpan] | None = None
        self._sequencer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferry-disk")  # slot order
        self._readers = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ferry-disk-read")
        self._lock = threading.Lock()
        self.read_bytes = 0
        self.read_seconds = 0.0
        self.wait_seconds = 0.0
        self.reads = 0
        self.unused_reads = 0  # read ahead, then not asked for (the order changed)

    # ----------------------------------------------------------------- the copy path (flat.py, ring.py)
    def take(self, span: DiskSpan) -> torch.Tensor:
        """``span``'s bytes in a staging slot, there when this returns (a host wait if its read is not done:
        the step is then bound by the disk). The caller copies out of it, then calls `copied`."""
        assert self._current is None, "a staging slot is taken twice without a copy between"
        if self._recording is not None:
            self._recording.append(span)
        entry = self._pop_queued(span)
        if entry is None:  # out of the recorded order (or none yet): read it now
            self._abandon(list(self._queue))
            self._queue.clear()
            position = self._position.get(id(span))
            if position is not None:
                self._cursor = (position + 1) % len(self._cycle)
            entry = self._issue(span)
        started = time.perf_counter()
        entry.future.result()  # raises CheckpointChanged, naming the file
        self.wait_seconds += time.perf_counter() - started
        self._current = entry
        return self._slot(entry.slot)[: span.nbytes]

    def copied(self, event: torch.cuda.Event | None) -> None:
        """The copy out of the taken slot is queued (``event`` marks its end; on CUDA without one, the current
        stream's work so far): the slot may be refilled once it has run. Starts the reads ahead."""
        entry, self._current = self._current, None
        assert entry is not None
        if event is None and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._slot_events[entry.slot] = event
        self._free.append(entry.slot)
        self._read_ahead()

    # ----------------------------------------------------------------- the order
    def record_next_step(self) -> None:
        """Learn the read order from the next step (called when the schedule is fixed or changes)."""
        self._recording = []

    def end_step(self) -> None:
        """A step ended: a step being recorded becomes the cycle the reads follow from now on."""
        if self._recording is None:
            return
        self._abandon(list(self._queue))  # read ahead in the old order
        self._queue.clear()
        self._cycle, self._recording = self._recording, None
        self._position = {}
        for index, span in enumerate(self._cycle):
            self._position.setdefault(id(span), index)
        self._cursor = 0
        self._read_ahead()  # the next step's first reads start while the optimizer steps

    def _pop_queued(self, span: DiskSpan) -> _Entry | None:
        for index, entry in enumerate(self._queue):
            if entry.span is span:
                skipped = [self._queue.popleft() for _ in range(index)]
                self._abandon(skipped)
                return self._queue.popleft()
        return None

    def _abandon(self, entries: list[_Entry]) -> None:
        """Reads nobody will take: their slots are free (a read still running finishes first: the sequencer
        runs the next read of that slot after it)."""
        for entry in entries:
            self._slot_events[entry.slot] = None
            self._free.append(entry.slot)
        self.unused_reads += len(entries)

    def _read_ahead(self) -> None:
        while self._free and self._cycle and len(self._queue) < len(self._cycle):
            span = self._cycle[self._cursor]
            self._cursor = (self._cursor + 1) % len(self._cycle)
            self._queue.append(self._issue(span))

    def _issue(self, span: DiskSpan) -> _Entry:
        slot = self._free.popleft()
        after = self._slot_events[slot]
        self._slot_events[slot] = None
        future = self._sequencer.submit(self._read, span, self._slot(slot), after)
        return _Entry(span, slot, future)

    def _slot(self, index: int) -> torch.Tensor:
        return self.buffer[index * self.stride : (index + 1) * self.stride]

    # ----------------------------------------------------------------- reading (the sequencer thread)
    def _read(self, span: DiskSpan, slot: torch.Tensor, after: torch.cuda.Event | None) -> float:
        if after is not None:
            after.synchronize()  # the copy that last read this slot has run (a wait on this thread only)
        started = time.perf_counter()
        view = memoryview(slot.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
        files = {piece.path for _, piece in span.pieces}
        for path in files:
            self.files[path].check()
        chunk = self._chunk if any(self.files[path].direct for path in files) else READ_CHUNK_BYTES
        jobs = [
            self._readers.submit(
                self._read_piece, piece.path, view, offset + at, piece.start + at, min(n, piece.nbytes - at)
            )
            for offset, piece in span.pieces
            for at, n in ((at, chunk) for at in range(0, piece.nbytes, chunk))
        ]
        for job in jobs:
            job.result()
        for path in files:  # a change while reading: the bytes may be half old, half new
            self.files[path].check(os.fstat(self.files[path].fd))
            self.files[path].check()
        seconds = time.perf_counter() - started
        with self._lock:
            self.read_bytes += span.nbytes
            self.read_seconds += seconds
            self.reads += 1
        return seconds

    def _read_piece(self, path: Path, view: memoryview, at: int, offset: int, nbytes: int) -> None:
        done, fd = 0, self.files[path].fd
        if self.files[path].direct:
            self._read_piece_direct(path, view, at, offset, nbytes)
            return
        while done < nbytes:
            got = os.preadv(fd, [view[at + done : at + nbytes]], offset + done)
            if got <= 0:
                raise CheckpointChanged(
                    f"model weights file {path} ends at byte {offset + done}, before the {nbytes} bytes at {offset} "
                    "that the job streams from it: the file was truncated; restore it and resume the job"
                )
            done += got
        # Host memory is short by assumption: the bytes just read are not kept in the page cache, where they
        # would push out other memory (another job's) and hide the disk's own rate.
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def _read_piece_direct(self, path: Path, view: memoryview, at: int, offset: int, nbytes: int) -> None:
        bounce = getattr(self._bounces, "buffer", None)
        if bounce is None:  # this thread's first direct read
            bounce = self._bounces.buffer = memoryview(aligned_empty(self._chunk + 2 * ALIGNMENT).numpy())  # type: ignore[arg-type]
        fd = self.files[path].fd
        for done in range(0, nbytes, self._chunk):
            n = min(self._chunk, nbytes - done)
            if read_direct(fd, view[at + done : at + done + n], offset + done, bounce) < n:
                raise CheckpointChanged(
                    f"model weights file {path} ends before byte {offset + done + n}, within the {nbytes} bytes at "
                    f"{offset} that the job streams from it: the file was truncated; restore it and resume the job"
                )

    # ----------------------------------------------------------------- resting views, detach
    def resting_view(self, piece: FileRange, like: torch.Tensor) -> torch.Tensor | None:
        """A view of ``piece`` in its file's private map, shaped like ``like`` (None when its offset does not
        suit the dtype's alignment)."""
        if piece.start % like.element_size():
            return None
        flat = self.files[piece.path].mapped()[piece.start : piece.end].view(like.dtype)
        return flat.view(like.shape) if like.is_contiguous() else None

    def read_copy(self, piece: FileRange, like: torch.Tensor) -> torch.Tensor:
        """``piece`` read into ordinary memory, checked, shaped like ``like`` (a detached model's own copy)."""
        out = torch.empty(piece.nbytes, dtype=torch.uint8)
        self.files[piece.path].check()
        self._read_piece(piece.path, memoryview(out.numpy()), 0, piece.start, piece.nbytes)  # type: ignore[arg-type]
        self.files[piece.path].check()
        return out.view(like.dtype).view(like.shape)

    def close(self) -> None:
        """Finish the reads in flight and close the files (the maps live while a view of them does)."""
        self._sequencer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        for handle in self.files.values():
            handle.close()
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False

    def __repr__(self) -> str:
        return f"DiskStage({len(self._slot_events)} slots x {self.stride} bytes, files={len(self.files)})"
