"""Pinned copies that keep the host-device link busy in the background, for rows that ask what a link busy with
copies costs work that does not copy: the CPU optimizer (optimizer_quant_bench.py), and a resident step that
the host bounds (optimizer_quant_bench.py's LoRA stack, diffusion_bench.py's DiT).

An offloaded step differs from its resident baseline in two ways: the engine's own host work (hooks, copy
launches, events), and the copies themselves, which read pinned host memory at the link's rate while the
host runs the step's Python and kernel launches. A resident step run under this load has the second and
not the first, so it tells the two apart. The load copies continuously, more than a step's copies (which
leave the link idle part of the step): its effect is an upper bound on theirs.

    with BackgroundCopies(directions=("h2d",)) as load:
        ...  # the work measured
    print(load.describe())
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

import torch

CHUNK_BYTES = 512 * 2**20  # one copy: large enough to run at the link's rate


class BackgroundCopies:
    """Copies of ``CHUNK_BYTES`` looping on side streams of a thread of their own until ``stop()``:
    host to device (``"h2d"``) and/or device to host (``"d2h"``), from and to pinned memory."""

    def __init__(self, directions: tuple[str, ...] = ("h2d", "d2h"), device: str = "cuda") -> None:
        unknown = set(directions) - {"h2d", "d2h"}
        if unknown or not directions:
            raise ValueError(f"directions must be some of 'h2d', 'd2h'; got {directions!r}")
        self.directions = directions
        numel = CHUNK_BYTES // 4
        self._host = {d: torch.empty(numel, pin_memory=True) for d in directions}
        self._device = {d: torch.empty(numel, device=device) for d in directions}
        self.copied_bytes = 0
        self._running = True
        self._started = time.perf_counter()
        self._seconds = 0.0
        self._thread = threading.Thread(target=self._loop, args=(device,), daemon=True)
        self._thread.start()

    def _loop(self, device: str) -> None:
        streams = {d: torch.cuda.Stream(device) for d in self.directions}
        while self._running:
            for direction, stream in streams.items():
                with torch.cuda.stream(stream):
                    if direction == "h2d":
                        self._device[direction].copy_(self._host[direction], non_blocking=True)
                    else:
                        self._host[direction].copy_(self._device[direction], non_blocking=True)
            for stream in streams.values():
                stream.synchronize()  # releases the GIL while the copies run
            self.copied_bytes += CHUNK_BYTES * len(streams)

    def stop(self) -> None:
        if self._running:
            self._running = False
            self._thread.join()
            self._seconds = time.perf_counter() - self._started

    def __enter__(self) -> BackgroundCopies:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def gbps(self) -> float:
        """The rate the load ran at, all directions together (GB/s, 1e9 bytes)."""
        seconds = self._seconds or (time.perf_counter() - self._started)
        return self.copied_bytes / seconds / 1e9 if seconds > 0 else 0.0

    def describe(self) -> str:
        names = {"h2d": "host to device", "d2h": "device to host"}
        return f"{' and '.join(names[d] for d in self.directions)} copies in the background at {self.gbps():.0f} GB/s"
