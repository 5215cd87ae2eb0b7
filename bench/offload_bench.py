"""Offload engine benchmark on one GPU: step time and peak memory, each mode beside its baselines.

Run on a GPU box:  python bench/offload_bench.py [--workloads toy,lora4k,lora16k] [--steps 8]
Prints a table and writes bench/RESULTS.md (date, GPU, torch, commit, figures).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload import OffloadOptions, OffloadTrainingManager  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS.md")


class ToyModel(nn.Module):
    """The seed's toy model: 10 x Linear(4096, 4096) with pre-norm residuals."""

    def __init__(self, width: int = 4096, depth: int = 10) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(F.layer_norm(x, (x.shape[-1],)))
        return x


@dataclass
class Result:
    workload: str
    mode: str
    step_ms: float
    peak_gib: float
    note: str = ""


def measure(step: Callable[[], None], steps: int, warmup: int = 2) -> tuple[float, float]:
    """Median step time (ms) and peak allocated GPU memory (GiB) over ``steps`` timed steps."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def toy_step(model: nn.Module, optimizer: torch.optim.Optimizer, manager: OffloadTrainingManager | None,
             batch: int = 512, width: int = 4096) -> Callable[[], None]:
    def step() -> None:
        x = torch.randn((batch, width), device="cuda")
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        if manager is not None:
            manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def run_toy(mode: str, steps: int) -> Result:
    torch.manual_seed(0)
    model = ToyModel()
    manager = None
    note = ""
    if mode == "resident":
        model.to("cuda")
    elif mode.startswith("ferry"):
        optimizer_offload = "optimizer-offload" in mode
        options = OffloadOptions(prefetch=0) if "prefetch0" in mode else OffloadOptions()
        manager = OffloadTrainingManager(model, "cuda", enable_optimizer_cpu_offload=optimizer_offload,
                                         options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_ms, peak = measure(toy_step(model, optimizer, manager), steps)
    if manager is not None:
        stats = manager.stats()
        note = (f"h2d {stats.last_step_h2d_bytes / 1e9:.2f} GB/step, d2h {stats.last_step_d2h_bytes / 1e9:.2f} GB/step, "
                f"pinned {stats.pinned_reserved_bytes / 2**30:.2f} GiB")
        manager.remove()
    return Result("toy", mode, step_ms, peak, note)


def pinned_h2d_gbps(nbytes: int = 1 << 30) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


WORKLOADS: dict[str, tuple[Callable[[str, int], Result], list[str]]] = {
    "toy": (run_toy, ["resident", "ferry", "ferry-optimizer-offload"]),
}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(results: list[Result]) -> str:
    lines = ["| workload | mode | median step (ms) | peak GPU (GiB) | notes |", "|---|---|---|---|---|"]
    lines += [f"| {r.workload} | {r.mode} | {r.step_ms:.1f} | {r.peak_gib:.2f} | {r.note} |" for r in results]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("offload_bench needs a CUDA GPU")
    h2d = pinned_h2d_gbps()
    results = []
    for name in args.workloads.split(","):
        runner, modes = WORKLOADS[name]
        for mode in modes:
            results.append(runner(mode, args.steps))
            print(table(results[-1:]).splitlines()[-1], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    header = (f"Offload engine benchmark — {datetime.date.today()} — {torch.cuda.get_device_name()} — "
              f"torch {torch.__version__} — commit {commit()}\n\n"
              f"Measured floor in this run: pinned host→device copy {h2d:.1f} GB/s.\n\n"
              f"Reproduce: `python bench/offload_bench.py --workloads {args.workloads} --steps {args.steps}`\n")
    text = header + "\n" + table(results) + "\n"
    print("\n" + text)
    if not args.no_write:
        RESULTS.write_text("# Benchmark results\n\n## Offload engine\n\n" + text)


if __name__ == "__main__":
    main()
