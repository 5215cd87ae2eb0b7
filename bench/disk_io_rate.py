"""Read rate of the disk tier's two ways of reading (``offload.disk_io``): O_DIRECT and buffered.

Writes a file of ``--mb`` MB (float32 tensors at unaligned offsets, as in a safetensors file), then reads it
through a `DiskStage` in each mode, dropping the file's pages from the cache between runs (posix_fadvise
DONTNEED; cold reads where the kernel honours it), and prints MB/s. Runs on the CPU; no GPU needed.

    PYTHONPATH=. python bench/disk_io_rate.py --mb 200 --folder /tmp
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from offload.disk import DiskSpan, DiskStage, FileRange

UNIT_BYTES = 16 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = args.folder / "ferry_disk_io_rate.bin"
    nbytes = args.mb * 10**6
    with path.open("wb") as handle:  # an 8-byte-plus-header offset, as safetensors' tensors have
        handle.write(os.urandom(nbytes))
    os.sync()
    header = 8 + 1234
    spans = []
    for index, start in enumerate(range(header, nbytes - UNIT_BYTES, UNIT_BYTES)):
        spans.append(DiskSpan(f"unit{index}", [(0, FileRange(path, start, start + UNIT_BYTES))], UNIT_BYTES))
    try:
        for mode in ("direct", "buffered") * args.repeats:
            stage = DiskStage(
                [path], slots=1, slot_bytes=UNIT_BYTES, pin=False, device=torch.device("cpu"), disk_io=mode
            )
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold start for both
            os.close(fd)
            started = time.perf_counter()
            for span in spans:
                stage.take(span)
                stage.copied(None)
            seconds = time.perf_counter() - started
            stage.close()
            read = len(spans) * UNIT_BYTES
            print(f"{mode:8s} {read / 1e6:.0f} MB in {seconds:.3f} s: {read / seconds / 1e6:.0f} MB/s")
    finally:
        path.unlink()


if __name__ == "__main__":
    main()
