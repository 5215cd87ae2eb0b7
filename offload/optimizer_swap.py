"""The CPU optimizer's state on disk: each parameter's moments live in a swap file, read before its update and
written back after it, so host memory holds only a ring of a few parameters' state (ZeRO-Infinity's optimizer
swapping).

Under optimizer offload with a full fine-tune, AdamW's two moments are twice the trainable weights: a 7B
model's 56 GB in float32, beside its 28 GB of masters. Where host memory cannot hold them,
``attach_optimizer(swap_folder=...)`` keeps each parameter's state tensors (every non-scalar tensor of its
optimizer state; scalars such as Adam's ``step`` stay in memory) in one file of that folder. Before the worker
thread updates a parameter (optimizer_step.py) its state is read into a slot of the *swap ring* and the state's
entries point into the slot; after the update the slot is written back and the entries point at the file again.
A state the optimizer made in memory (its first step, or a checkpoint's state loaded before attaching) is
written out and dropped.

Reads run ahead on an I/O thread, in the order learned from the last round of updates (the order of the
parameters' previous updates, as ``DiskStage`` learns its units'); a parameter asked for out of that order is
read at once (slower, never wrong). Reads and writes run on one sequencer thread in the order they are issued,
so a slot written back is read into again only after its write, and a parameter's read comes after its last
write: no slot needs a lock.

The files are read and written as ``disk_io`` says (direct_io.py): with ``O_DIRECT`` past the page cache, whose
copies of the state would count against the very host memory the swap spares. Ferry lays its files out for it:
each state tensor starts at a multiple of 4096 bytes and its length is padded to one, and the ring's slots are
4096-aligned, so every read and write is aligned as it stands (no bounce buffer). The folder's filesystem is
probed once, when the swap is made: ``auto`` falls back to the page cache saying why (``fallback``), ``direct``
refuses before any update.

Between updates each state tensor is a view of its file's shared memory map, so ``optimizer.state_dict()`` (a
checkpoint) reads the true values; the engine itself never reads through the map. A swap file another process
truncates or replaces fails the job naming the file (`SwapFileDamaged`); a failed write (a full disk) too
(`SwapWriteFailed`): the optimizer never steps from other bytes than it wrote.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from offload.direct_io import align_up, aligned_empty, probe_folder

log = logging.getLogger(__name__)

IO_CHUNK_BYTES = 16 << 20  # one preadv/pwritev; a parameter's I/O is split so that several threads share it


class SwapFileDamaged(RuntimeError):
    """A swap file of the CPU optimizer's state changed on disk behind the engine (truncated, replaced, removed)."""


class SwapWriteFailed(RuntimeError):
    """Writing the CPU optimizer's state to its swap file failed (a full disk, an I/O error)."""


class _SwapFile:
    """One parameter's swapped state: its file, the state keys it holds and where each lies in it."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor], *, direct: bool) -> None:
        self.path = path
        self.direct = direct
        self.keys = list(tensors)
        self.likes = {k: (t.shape, t.dtype) for k, t in tensors.items()}
        self.offsets: dict[str, int] = {}
        offset = 0
        for key, tensor in tensors.items():
            self.offsets[key] = offset
            offset += align_up(tensor.numel() * tensor.element_size())  # O_DIRECT's unit: every key's I/O is aligned
        self.nbytes = offset
        if path.exists():
            path.unlink()  # an earlier attempt's file: a map of it (that attempt's state) stays valid
        direct_flag = os.O_DIRECT if direct else 0  # OptimizerSwap probed the folder's filesystem for it
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | direct_flag, 0o600)
        os.ftruncate(self.fd, self.nbytes)
        self.inode = os.fstat(self.fd).st_ino
        self._map: torch.Tensor | None = None

    def check(self) -> None:
        """Raise `SwapFileDamaged` if the file is no longer the engine's (its size, or another file at its path)."""
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        size = os.fstat(self.fd).st_size
        if now is None or now.st_ino != self.inode or size != self.nbytes:
            found = "it is gone" if now is None else f"size {self.nbytes} -> {size}, inode {self.inode} -> {now.st_ino}"
            raise SwapFileDamaged(
                f"optimizer state swap file {self.path} changed on disk while the job keeps the CPU optimizer's state "
                f"there ({found}); the job stops rather than step from other state: resume it from its last "
                "checkpoint, and leave the swap folder to the job"
            )

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state tensors as views of ``buffer``, laid out as in the file."""
        out = {}
        for key in self.keys:
            shape, dtype = self.likes[key]
            start = self.offsets[key]
            count = shape.numel() * torch.empty((), dtype=dtype).element_size()
            out[key] = buffer[start : start + count].view(dtype).view(shape)
        return out

    def resting(self) -> dict[str, torch.Tensor]:
        """The state tensors as views of the file's shared map (pages come from the file when touched)."""
        if self._map is None:
            self._map = torch.from_file(str(self.path), shared=True, size=self.nbytes, dtype=torch.uint8)
        return self.views(self._map)

    def close(self) -> None:
        os.close(self.fd)


class _Read:
    """A read into a ring slot: issued ahead (or on demand), then taken by its parameter's update."""

    __slots__ = ("future", "key", "slot")

    def __init__(self, key: int, slot: int, future: Future[None]) -> None:
        self.key, self.slot, self.future = key, slot, future


class OptimizerSwap:
    """The swap folder, its files and the ring that parameters' state is read into for their updates.

    Args:
        folder: where the swap files go (created; emptied of an earlier attempt's files).
        slots: ring slots, each the size of the largest parameter's state: the parameters being updated (at
            most ``slots`` at once, ``batch_limit``) plus those read ahead.
        threads: parallel reads and writes within one parameter's state.
        disk_io: ``auto`` (``O_DIRECT`` where the folder's filesystem allows, else through the page cache),
            ``direct`` (``O_DIRECT`` or `DirectIOUnsupported`, here, before any update) or ``buffered``.

    Example:
        >>> swap = OptimizerSwap(tmp_path / "optimizer_swap", slots=3)
        >>> swap.swap_in(key, name, optimizer.state[param]); optimizer.step(); swap.swap_out(key, name, state)
    """

    def __init__(self, folder: Path, *, slots: int = 3, threads: int = 4, disk_io: str = "auto") -> None:
        if slots < 1:
            raise ValueError(f"the optimizer swap ring needs at least one slot; got {slots}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("*.swap"):  # an earlier attempt's: the state now comes from its checkpoint
            stale.unlink()
        # Why disk_io auto writes through the page cache (the job says so once), None where it need not.
        self.fallback = probe_folder(self.folder, disk_io, fix=_KEEP_LOCAL)
        self.direct = disk_io != "buffered" and self.fallback is None
        self.slots = slots
        self.files: dict[int, _SwapFile] = {}
        self._stride = 0  # the ring's slot size: the largest file when the ring was made
        self._ring = aligned_empty(0)
        self._free: deque[int] = deque()
        self._ahead: dict[int, _Read] = {}  # read ahead, not yet taken (insertion order: issue order)
        self._taken: dict[int, tuple[_Read | None, torch.Tensor]] = {}  # being updated: its read, its buffer
        self._writes: deque[Future[None]] = deque()
        self.failed: BaseException | None = None  # the first failed read or write
        self._made = 0  # files made: each one's number in its name
        self._cycle: list[int] = []  # the keys of the last full round of updates, in order
        self._round: list[int] = []
        self._in_round: set[int] = set()
        self._sequencer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferry-swap")  # I/O order
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ferry-swap-io")
        self.read_bytes = 0
        self.written_bytes = 0
        self.wait_seconds = 0.0  # the worker's time waiting for a read
        self.unused_reads = 0  # read ahead, then dropped (the order changed, or a checkpoint)
        self.demand_reads = 0  # read when asked for, not ahead (the worker waited for the whole read)

    @property
    def batch_limit(self) -> int:
        """How many parameters one optimizer call may update at once: each holds a slot meanwhile."""
        return self.slots

    @property
    def ring_bytes(self) -> int:
        return self._ring.numel()

    @property
    def swapped_bytes(self) -> int:
        """The state bytes kept in the swap files."""
        return sum(f.nbytes for f in self.files.values())

    # ----------------------------------------------------------------- around an update (the worker thread)
    def swap_in(self, key: int, state: dict[str, Any]) -> None:
        """Before ``key``'s update: its swapped state read into a ring slot (waited for here) and ``state``'s
        entries pointed there. A parameter with no state on disk yet (its first update) is left alone."""
        self._raise_write_errors()
        self._record(key)
        swap_file = self.files.get(key)
        if swap_file is None:
            return
        assert key not in self._taken, "a parameter's state is swapped in twice without its update between"
        read = self._ahead.pop(key, None)
        buffer: torch.Tensor
        # Larger than the ring's slots: the ring grows when idle, else this one gets a buffer of its own.
        if read is None and swap_file.nbytes > self._stride and not self._taken and not self._ahead:
            self._grow(max(f.nbytes for f in self.files.values()))
        if read is not None:
            buffer = self._slot(read.slot)
        elif swap_file.nbytes > self._stride:
            buffer = aligned_empty(swap_file.nbytes)
            read = _Read(key, -1, self._sequencer.submit(self._read, swap_file, buffer))
        else:
            self.demand_reads += 1
            slot = self._free_slot()
            buffer = self._slot(slot)
            read = _Read(key, slot, self._sequencer.submit(self._read, swap_file, buffer))
        started = time.perf_counter()
        try:
            read.future.result()  # raises SwapFileDamaged, naming the file
        except BaseException as error:
            self.failed = error  # every later swap raises it: none steps from state the job cannot vouch for
            raise
        self.wait_seconds += time.perf_counter() - started
        self._taken[key] = (read if read.slot >= 0 else None, buffer)
        state.update(swap_file.views(buffer))
        self._read_ahead(key)

    def swap_out(self, key: int, name: str, state: dict[str, Any]) -> None:
        """After ``key``'s update: its state written back (read from its slot on the I/O thread, which frees
        the slot for reads issued after it) and ``state``'s entries pointed at the file. A state made in memory
        is given a file, written at once and dropped."""
        taken = self._taken.pop(key, None)
        tensors = _swappable(state)
        swap_file = self.files.get(key)
        if swap_file is None or list(tensors) != swap_file.keys or taken is None:
            if taken is not None and taken[0] is not None:
                self._free.append(taken[0].slot)
            swap_file = self._make_file(key, name, tensors)
            self._settle(self._sequencer.submit(self._write_tensors, swap_file, tensors))  # before they are dropped
            state.update(swap_file.resting())
            del tensors
            _return_freed_memory()
            return
        else:
            read, buffer = taken
            views = swap_file.views(buffer)
            for key_name, tensor in tensors.items():  # an optimizer that replaced a state tensor: its new values
                if tensor.data_ptr() != views[key_name].data_ptr():
                    views[key_name].copy_(tensor)
            self._writes.append(self._sequencer.submit(self._write, swap_file, buffer))
            if read is not None:
                self._free.append(read.slot)  # refilled only by a read queued after the write
        state.update(swap_file.resting())
        self._raise_write_errors()

    def flush(self) -> None:
        """Every write finished and every file checked (before a checkpoint reads the state through the maps).
        Reads ahead are dropped: their slots are free again."""
        for read in list(self._ahead.values()):
            self._drop(read)
        self._sequencer.submit(lambda: None).result()  # the I/O issued so far is done
        self._raise_write_errors()
        for swap_file in self.files.values():
            self._settle(swap_file.check)

    def _settle(self, work: Future[None] | Callable[[], None]) -> None:
        """Wait for ``work`` (or run it); a failure becomes the swap's (`_raise_write_errors`)."""
        try:
            work.result() if isinstance(work, Future) else work()
        except BaseException as error:
            self.failed = error
            raise

    def take_in_memory(self, state: dict[str, Any], key: int) -> None:
        """``key``'s swapped state copied into memory of its own (detaching the engine with ``copy=True``)."""
        swap_file = self.files.get(key)
        if swap_file is None:
            return
        buffer = aligned_empty(swap_file.nbytes)
        self._sequencer.submit(self._read, swap_file, buffer).result()
        state.update(swap_file.views(buffer))

    def close(self) -> None:
        """Finish the I/O in flight and close the files (the maps live while a view of them does)."""
        self._sequencer.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        for swap_file in self.files.values():
            swap_file.close()

    def remove_files(self) -> None:
        """Delete the swap files, and the folder if nothing else is in it (a file stays readable through the
        maps that views of it still hold)."""
        for swap_file in self.files.values():
            swap_file.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.folder.rmdir()

    # ----------------------------------------------------------------- the ring and the order
    def _make_file(self, key: int, name: str, tensors: dict[str, torch.Tensor]) -> _SwapFile:
        old = self.files.pop(key, None)
        if old is not None:
            old.close()
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:120] or "param"
        self._made += 1
        swap_file = _SwapFile(self.folder / f"{self._made:05d}-{safe}.swap", tensors, direct=self.direct)
        self.files[key] = swap_file
        return swap_file

    def _grow(self, stride: int) -> None:
        self._sequencer.submit(lambda: None).result()  # nothing reads or writes the old ring now
        self._stride = align_up(stride)
        self._ring = aligned_empty(self.slots * self._stride)  # O_DIRECT reads and writes land in it
        self._free = deque(range(self.slots))

    def _slot(self, index: int) -> torch.Tensor:
        return self._ring[index * self._stride : (index + 1) * self._stride]

    def _free_slot(self) -> int:
        if not self._free and self._ahead:
            self._drop(next(reversed(self._ahead.values())))  # the read ahead furthest off
        assert self._free, "more parameters updated at once than the swap ring has slots (batch_limit)"
        return self._free.popleft()

    def _drop(self, read: _Read) -> None:
        """A read ahead nobody takes: its slot is free (a read still running finishes first: the sequencer
        runs the next I/O of that slot after it)."""
        del self._ahead[read.key]
        self._free.append(read.slot)
        self.unused_reads += 1

    def _record(self, key: int) -> None:
        """Learn the order: a key seen again closes the round, which becomes the order reads follow."""
        if key in self._in_round:
            self._cycle = self._round
            self._round, self._in_round = [], set()
        self._round.append(key)
        self._in_round.add(key)

    def _read_ahead(self, after: int) -> None:
        if after not in self._cycle or self._stride == 0:
            return
        start = self._cycle.index(after)
        for step in range(1, len(self._cycle)):
            if not self._free:
                return
            key = self._cycle[(start + step) % len(self._cycle)]
            if key in self._taken:
                return  # the round has come back to the update in progress
            swap_file = self.files.get(key)
            if key in self._ahead or swap_file is None or swap_file.nbytes > self._stride:
                continue
            slot = self._free.popleft()
            self._ahead[key] = _Read(key, slot, self._sequencer.submit(self._read, swap_file, self._slot(slot)))

    def _raise_write_errors(self) -> None:
        """A failed read or write fails every later swap: the file no longer holds the state the optimizer made."""
        if self.failed is not None:
            raise self.failed
        while self._writes and self._writes[0].done():
            error = self._writes.popleft().exception()
            if error is not None:  # SwapWriteFailed or SwapFileDamaged, naming the file
                self.failed = error
                raise error

    # ----------------------------------------------------------------- I/O (the sequencer thread)
    def _read(self, swap_file: _SwapFile, buffer: torch.Tensor) -> None:
        swap_file.check()
        view = memoryview(buffer.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
        self._chunked(swap_file, self._read_piece, view, swap_file.nbytes)
        swap_file.check()
        self.read_bytes += swap_file.nbytes

    def _write(self, swap_file: _SwapFile, buffer: torch.Tensor) -> None:
        swap_file.check()  # never extend a file someone truncated: that would hide it
        view = memoryview(buffer.numpy())  # type: ignore[arg-type]
        self._chunked(swap_file, self._write_piece, view, swap_file.nbytes)
        self.written_bytes += swap_file.nbytes

    def _write_tensors(self, swap_file: _SwapFile, tensors: dict[str, torch.Tensor]) -> None:
        if swap_file.direct:  # O_DIRECT writes from aligned memory only: the tensors are laid out as in the file
            buffer = aligned_empty(swap_file.nbytes)
            for key, place in swap_file.views(buffer).items():
                place.copy_(tensors[key])
            self._write(swap_file, buffer)
            return
        for key, tensor in tensors.items():
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            view = memoryview(flat.numpy())  # type: ignore[arg-type]
            self._write_piece(swap_file, view, 0, swap_file.offsets[key], flat.numel())
        self.written_bytes += swap_file.nbytes

    def _chunked(
        self,
        swap_file: _SwapFile,
        piece: Callable[[_SwapFile, memoryview, int, int, int], None],
        view: memoryview,
        n: int,
    ) -> None:
        jobs = [
            self._pool.submit(piece, swap_file, view, at, at, min(IO_CHUNK_BYTES, n - at))
            for at in range(0, n, IO_CHUNK_BYTES)
        ]
        for job in jobs:
            job.result()

    @staticmethod
    def _read_piece(swap_file: _SwapFile, view: memoryview, at: int, offset: int, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            got = os.preadv(swap_file.fd, [view[at + done : at + nbytes]], offset + done)
            if got <= 0:
                raise SwapFileDamaged(
                    f"optimizer state swap file {swap_file.path} ends at byte {offset + done}, before the "
                    f"{swap_file.nbytes} bytes of state the job wrote there: it was truncated; resume the job from "
                    "its last checkpoint"
                )
            done += got

    @staticmethod
    def _write_piece(swap_file: _SwapFile, view: memoryview, at: int, offset: int, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            try:
                wrote = os.pwrite(swap_file.fd, view[at + done : at + nbytes], offset + done)
            except OSError as error:
                raise SwapWriteFailed(
                    f"writing the CPU optimizer's state to swap file {swap_file.path} failed ({error.strerror or error}); "
                    f"free space on the disk of {swap_file.path.parent}, or raise offload.host_memory_limit so that "
                    "the state stays in memory"
                ) from error
            done += wrote

    def __repr__(self) -> str:
        return (
            f"OptimizerSwap({self.folder}, {len(self.files)} files, {self.swapped_bytes} bytes, "
            f"ring {self.slots} x {self._stride} bytes)"
        )


_KEEP_LOCAL = "or keep the job's output folder (its optimizer_swap/ folder) on a local disk (ext4, xfs)"


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def _return_freed_memory() -> None:
    """Give the memory of a state just dropped back to the system. The optimizer made it in ordinary memory (its
    first step, or a checkpoint's state), in blocks glibc keeps in its heaps once freed (below its dynamic mmap
    threshold, up to 32 MiB): the process would keep the memory the swap exists to spare (measured: about half of
    the state of a 25M-weight model). ``malloc_trim`` returns the free pages of every heap."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _swappable(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state entries kept on disk: every non-scalar CPU tensor (moments, momentum), in the state's order."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() > 0}
