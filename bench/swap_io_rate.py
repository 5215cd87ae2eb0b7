"""Rate of the CPU optimizer's swap files (``offload.disk_io``): O_DIRECT against buffered reads and writes.

Makes ``--params`` weights' AdamW state of ``--mb`` MB each in an `OptimizerSwap` in ``--folder``, then runs
``--rounds`` rounds of what a step does to it (each weight's state read into the ring, changed, written back),
and prints per mode the state's bytes read and written per second and how much of the swap files the page cache
holds at the end (``fincore``). Between rounds the files' pages are dropped (posix_fadvise DONTNEED), so buffered
reads come from the disk as far as the kernel honours it. Runs on the CPU; no GPU needed.

    PYTHONPATH=. python bench/swap_io_rate.py --params 32 --mb 16 --folder /tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from offload.optimizer_swap import OptimizerSwap


def cached_bytes(paths: list[Path]) -> int | None:
    """Bytes of ``paths`` in the page cache (util-linux ``fincore``), None where it is not installed."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *map(str, paths)], capture_output=True, text=True)
    return sum(int(line) for line in out.stdout.split())


def drop_pages(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def measure(mode: str, folder: Path, params: int, numel: int, rounds: int) -> str:
    swap = OptimizerSwap(folder / f"swap-{mode}", slots=3, disk_io=mode)
    states = {
        key: {"step": torch.tensor(0.0), "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}
        for key in range(params)
    }
    for key, state in states.items():  # the first step: each state made in memory goes to its file
        swap.swap_out(key, f"w{key}", state)
    swap.flush()
    paths = [f.path for f in swap.files.values()]
    best = float("inf")
    for _ in range(rounds):
        drop_pages(paths)
        started = time.perf_counter()
        for key, state in states.items():
            swap.swap_in(key, state)
            state["exp_avg"].add_(1.0)
            swap.swap_out(key, f"w{key}", state)
        swap.flush()
        best = min(best, time.perf_counter() - started)
    cached = cached_bytes(paths)  # before the check below, which reads through the files' maps
    assert all(float(s["exp_avg"][0]) == rounds for s in states.values()), "a round lost an update"
    moved = 2 * swap.swapped_bytes  # read once and written once a round
    swap.close()
    swap.remove_files()
    cache = "n/a (no fincore)" if cached is None else f"{cached / 2**20:.0f} MiB"
    return (
        f"{mode:8s} O_DIRECT={swap.direct!s:5s} state {swap.swapped_bytes / 2**30:.2f} GiB: best round {best:.3f} s, "
        f"{moved / best / 2**30:.2f} GiB/s read+write; swap files in the page cache {cache}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=32)
    parser.add_argument("--mb", type=int, default=16, help="each weight's float32 bytes (its state is twice this)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    numel = args.mb * 2**20 // 4
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        for mode in ("direct", "buffered"):
            print(measure(mode, Path(folder), args.params, numel, args.rounds))


if __name__ == "__main__":
    main()
