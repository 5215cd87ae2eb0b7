"""Pinned copies that keep the host-device link busy in the background, for rows that ask what a link busy with
copies costs work that does not copy: the CPU optimizer (optimizer_quant_bench.py), and a resident step that
the host bounds (optimizer_quant_bench.py's LoRA stack, diffusion_bench.py's DiT).

An offloaded step differs from its resident baseline in two ways: the engine's own host work (hooks, copy
launches, events), and the copies themselves, which read pinned host memory at the link's rate while the
host runs the step's Python and kernel launches. A resident step run under this load has the second and
not the first, so it tells the two apart. The load copies continuously, more than a step's copies (which
leave the link idle part of the step): its effect is an upper bound on theirs.

The copies run in a process of their own, with its own CUDA context: the measured process's
``torch.cuda.synchronize()`` does not wait for them and its interpreter lock is not shared with them, so
the only coupling is the machine's (host memory, the link, the CPU's caches), which is what is measured.

    with BackgroundCopies(directions=("h2d",)) as load:
        ...  # the work measured
    print(load.describe())
"""

from __future__ import annotations

import multiprocessing
import time
from types import TracebackType
from typing import Any

CHUNK_BYTES = 512 * 2**20  # one copy: large enough to run at the link's rate
DIRECTIONS = ("h2d", "d2h")


class BackgroundCopies:
    """Copies of ``CHUNK_BYTES`` looping on side streams of another process until ``stop()``: host to device
    (``"h2d"``) and/or device to host (``"d2h"``), from and to pinned memory. Returns once they run."""

    def __init__(self, directions: tuple[str, ...] = DIRECTIONS, device: str = "cuda", timeout: float = 120) -> None:
        unknown = set(directions) - set(DIRECTIONS)
        if unknown or not directions:
            raise ValueError(f"directions must be some of 'h2d', 'd2h'; got {directions!r}")
        self.directions = directions
        context = multiprocessing.get_context("spawn")  # a CUDA context of its own (fork would share ours)
        self._ready, self._stop = context.Event(), context.Event()
        self._figures = context.Array("d", 2)  # bytes copied, seconds copying
        self._process = context.Process(
            target=copy_loop,
            args=(directions, device, self._ready, self._stop, self._figures),
            daemon=True,
        )
        self._process.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if not self._process.is_alive():
                raise RuntimeError(
                    f"the background copies' process exited (code {self._process.exitcode}) before copying: "
                    f"is {device!r} a CUDA device?"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the background copies did not start within {timeout:.0f} s")

    def stop(self) -> None:
        self._stop.set()
        self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()

    def __enter__(self) -> BackgroundCopies:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def gbps(self) -> float:
        """The rate the load ran at, all directions together (GB/s, 1e9 bytes); 0 before any copy ended."""
        copied, seconds = self._figures[0], self._figures[1]
        return copied / seconds / 1e9 if seconds > 0 else 0.0

    def describe(self) -> str:
        names = {"h2d": "host to device", "d2h": "device to host"}
        return f"{' and '.join(names[d] for d in self.directions)} copies in the background at {self.gbps():.0f} GB/s"


def copy_loop(directions: tuple[str, ...], device: str, ready: Any, stop: Any, figures: Any) -> None:
    """The other process: copy ``CHUNK_BYTES`` each way asked until ``stop`` is set; ``figures`` gets the bytes
    copied and the seconds they took."""
    import torch

    numel = CHUNK_BYTES // 4
    host = {d: torch.empty(numel, pin_memory=True) for d in directions}
    target = {d: torch.empty(numel, device=device) for d in directions}
    streams = {d: torch.cuda.Stream(device) for d in directions}
    ready.set()
    start = time.perf_counter()
    while not stop.is_set():
        for direction, stream in streams.items():
            with torch.cuda.stream(stream):
                if direction == "h2d":
                    target[direction].copy_(host[direction], non_blocking=True)
                else:
                    host[direction].copy_(target[direction], non_blocking=True)
        for stream in streams.values():
            stream.synchronize()
        figures[0] += CHUNK_BYTES * len(streams)
        figures[1] = time.perf_counter() - start
