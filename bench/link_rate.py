"""The pinned host-to-device copy rate: the denominator of every copy floor in bench/RESULTS.md."""

from __future__ import annotations

import time

import torch


def pinned_h2d_gbps(nbytes: int = 1 << 30) -> float:
    """Pinned host-to-device copy rate in GB/s, measured now (NaN without CUDA)."""
    if not torch.cuda.is_available():
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm-up: the first copy pays for mapping the pages
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()  # a CPU-GPU sync point: the copies are asynchronous
    return 5 * nbytes / (time.perf_counter() - start) / 1e9
