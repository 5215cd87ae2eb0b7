"""``O_DIRECT`` I/O for the disk tier: checkpoint bytes and optimizer swap files past the page cache (``disk_io``).

Reads through the page cache leave a copy of every streamed byte in the kernel's cache, where it counts
against the host's memory (the very thing ``host_memory_limit`` is short of) and pushes out other jobs' pages.
``O_DIRECT`` reads go from the drive into the process's buffer. The kernel then asks that the file offset, the
length and the buffer's address are multiples of the device's logical block size; ``ALIGNMENT`` (4096) is one
for every drive in use. A tensor's bytes in a safetensors file start wherever the header's length puts them,
so each read covers the aligned span around them (start rounded down, end rounded up: a read past the end of
the file returns what is there, which is how the final partial block is read) into an aligned *bounce*
buffer, and the tensor's bytes are copied out of it to their place in the staging slot.

Some filesystems refuse ``O_DIRECT`` (EINVAL at ``open`` or at the first read: older tmpfs, some FUSE and
network mounts). `open_weights` finds out when the tier opens its files, and `probe_folder` when the optimizer's
swap folder is made (its files are Ferry's own, laid out aligned: offload/optimizer_swap.py), so ``direct`` fails
the job at start and ``auto`` falls back to the page cache once, saying so.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import torch

ALIGNMENT = 4096  # O_DIRECT's offset/length/address unit: a multiple of every drive's logical block size
DISK_IO_MODES = ("auto", "direct", "buffered")


class DirectIOUnsupported(ValueError):
    """``disk_io: direct`` on a file whose filesystem refuses ``O_DIRECT`` reads."""


def align_down(offset: int) -> int:
    return offset - offset % ALIGNMENT


def align_up(offset: int) -> int:
    return align_down(offset + ALIGNMENT - 1)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 whose data pointer is a multiple of `ALIGNMENT`: torch's CPU allocator promises 64
    bytes, so the tensor is carved out of one ``ALIGNMENT`` bytes larger (the view keeps it alive)."""
    backing = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    skip = -backing.data_ptr() % ALIGNMENT
    return backing[skip : skip + nbytes]


def open_weights(path: Path, mode: str) -> tuple[int, str | None]:
    """Open ``path`` for reading as ``mode`` (`DISK_IO_MODES`) asks: the descriptor, and why direct reads were
    wanted but not possible (``auto`` on a filesystem that refuses them; None otherwise).

    Raises:
        DirectIOUnsupported: ``mode`` is ``direct`` and the filesystem refuses ``O_DIRECT``.
    """
    fix = "or keep the checkpoint on a local disk (ext4, xfs) that supports O_DIRECT"
    return _open(path, mode, os.O_RDONLY, _probe_read, fix)


def probe_folder(folder: Path, mode: str, *, fix: str) -> str | None:
    """Whether files Ferry makes in ``folder`` (the optimizer's swap files) can be written and read with
    ``O_DIRECT`` as ``mode`` asks, tried on a probe file made and removed here: why not where ``auto`` falls
    back to the page cache, None where they can (or ``mode`` is ``buffered``). ``fix`` ends the refusal.

    Raises:
        DirectIOUnsupported: ``mode`` is ``direct`` and the filesystem refuses ``O_DIRECT``.
    """
    probe = folder / ".o_direct_probe"
    probe.unlink(missing_ok=True)
    try:
        fd, why = _open(probe, mode, os.O_RDWR | os.O_CREAT, _probe_write, fix)
        os.close(fd)
    finally:
        probe.unlink(missing_ok=True)
    return why if mode != "buffered" else None


def _open(path: Path, mode: str, flags: int, probe: Callable[[int], None], fix: str) -> tuple[int, str | None]:
    """``os.open(path, flags)``, with ``O_DIRECT`` where ``mode`` asks and ``probe(fd)`` (the first I/O, which
    some filesystems refuse although they accepted the flag at open) succeeds."""
    if mode == "buffered" or not hasattr(os, "O_DIRECT"):
        if mode == "direct":
            raise DirectIOUnsupported(_refusal(path, "this platform has no O_DIRECT", fix))
        return os.open(path, flags, 0o600), None if mode == "buffered" else "this platform has no O_DIRECT"
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return _fallback(path, mode, flags, f"open with O_DIRECT failed ({error.strerror})", fix)
    try:
        probe(fd)
    except OSError as error:
        os.close(fd)
        if error.errno != errno.EINVAL:
            raise
        return _fallback(path, mode, flags, f"an O_DIRECT read or write failed ({error.strerror})", fix)
    return fd, None


def _probe_read(fd: int) -> None:
    os.preadv(fd, [memoryview(aligned_empty(ALIGNMENT).numpy())], 0)  # type: ignore[arg-type]


def _probe_write(fd: int) -> None:
    block = memoryview(aligned_empty(ALIGNMENT).numpy())  # type: ignore[arg-type]
    os.pwritev(fd, [block], 0)
    os.preadv(fd, [block], 0)


def _fallback(path: Path, mode: str, flags: int, why: str, fix: str) -> tuple[int, str]:
    if mode == "direct":
        raise DirectIOUnsupported(_refusal(path, why, fix))
    return os.open(path, flags, 0o600), f"{path.parent} refuses O_DIRECT I/O: {why}"


def _refusal(path: Path, why: str, fix: str) -> str:
    return (
        f"offload.disk_io is 'direct' but the filesystem of {path} refuses O_DIRECT I/O ({why}); set "
        f"offload.disk_io to 'auto' (falls back to the page cache) or 'buffered', {fix}"
    )


def read_direct(fd: int, out: memoryview, offset: int, bounce: memoryview) -> int:
    """Read ``len(out)`` bytes at ``offset`` of the O_DIRECT descriptor ``fd`` into ``out``, through ``bounce`` (an
    aligned buffer at least ``len(out) + 2 * ALIGNMENT`` bytes long). Returns the bytes read: fewer than asked
    only where the file ends before them."""
    start, end = align_down(offset), align_up(offset + len(out))
    span = bounce[: end - start]
    got = 0
    while got < len(span):
        n = os.preadv(fd, [span[got:]], start + got)  # got stays a multiple of ALIGNMENT until the file ends
        if n <= 0:
            break
        got += n
        if got % ALIGNMENT:  # a short read not on a block boundary: the end of the file
            break
    useful = max(0, min(got - (offset - start), len(out)))
    out[:useful] = span[offset - start : offset - start + useful]
    return useful
