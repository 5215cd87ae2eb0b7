"""Offload engine benchmark on one GPU: step time and peak memory, each mode beside its baselines.

Run on a GPU box:  python bench/offload_bench.py [--workloads toy,lora4k,lora16k] [--steps 8] [--write]
Prints a table (date, GPU, torch, commit, figures); ``--write`` puts it into bench/RESULTS.md between its
``offload_bench`` markers, and the rest of the file stays as it is.

``--profile`` adds each row's profile (shares of the step, TFLOP/s, MFU: jobs/reporting/step_profile.py) to its
notes. The LoRA rows against plain transformers + peft are bench/speed_bench.py's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
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
from bench.doc_sections import replace_section
from bench.link_rate import pinned_h2d_gbps
from offload import OffloadOptions, OffloadTrainingManager

RESULTS = Path(__file__).with_name("RESULTS.md")
PROFILE: list[bool] = [False]  # --profile: each row's notes end with its profile
SECTION = "offload_bench"  # its text lies between <!-- offload_bench:start --> and <!-- offload_bench:end -->


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
    reserved_gib: float = float("nan")


_LAST_RESERVED: list[float] = [float("nan")]


def timed_steps(step: Callable[[], object], steps: int, warmup: int = 2) -> tuple[float, float, float]:
    """Median step ms, peak allocated and peak reserved GiB over ``steps`` timed steps after ``warmup``."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()  # a CPU-GPU sync point: each step's time includes its queued GPU work
        times.append((time.perf_counter() - start) * 1e3)
    gib = 2**30
    return statistics.median(times), torch.cuda.max_memory_allocated() / gib, torch.cuda.max_memory_reserved() / gib


def measure(step: Callable[[], None], steps: int, warmup: int = 2) -> tuple[float, float]:
    """Median step time (ms) and peak allocated GPU memory (GiB) over ``steps`` timed steps; the peak
    reserved memory of the same steps is kept for the row (``_LAST_RESERVED``)."""
    ms, allocated, reserved = timed_steps(step, steps, warmup)
    _LAST_RESERVED[0] = reserved
    return ms, allocated


def toy_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    manager: OffloadTrainingManager | None,
    batch: int = 512,
    width: int = 4096,
) -> Callable[[], None]:
    def step() -> None:
        x = torch.randn((batch, width), device="cuda")
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        if manager is not None:
            manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


MODES = {
    # name: (OffloadOptions or None for no manager, CPU optimizer fused?)
    # The seed's schedule copies on every visit: no ring slot reuse (ring.py) in its row.
    "ferry-prefetch0-leaf (seed)": (OffloadOptions(prefetch=0, granularity="leaf", reuse_ring_slots=False), False),
    "ferry-default": (OffloadOptions(), True),
    "ferry-leaf": (OffloadOptions(granularity="leaf"), True),
    "ferry-block": (OffloadOptions(granularity="block"), True),
    # + manager.attach_optimizer(optimizer): each parameter's CPU update runs while backward continues.
    "ferry-default+step-in-backward": (OffloadOptions(), True),
}


def stats_note(manager: OffloadTrainingManager) -> str:
    stats = manager.stats()
    return (
        f"h2d {stats.last_step_h2d_bytes / 1e9:.2f} GB/step at {stats.last_step_h2d_gbps:.0f} GB/s, "
        f"d2h {stats.last_step_d2h_bytes / 1e9:.2f} GB/step, copy wait "
        f"{stats.copy_wait_seconds / max(stats.steps, 1) * 1e3:.0f} ms/step, "
        f"pinned {stats.pinned_reserved_bytes / 2**30:.2f} GiB, ring {stats.planned_device_bytes / 2**30:.2f} GiB, "
        f"ring overflows {stats.ring_overflows}"
    )


def run_toy(mode: str, steps: int) -> Result:
    torch.manual_seed(0)
    model = ToyModel()
    manager = None
    if mode == "resident":
        model.to("cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif mode == "fsdp2":
        model = fsdp2_wrap(model, list(model.layers))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        options, fused = MODES[mode]
        manager = OffloadTrainingManager(model, "cuda", enable_optimizer_cpu_offload=True, options=options)
        # With the optimizer on the CPU, Ferry's runner uses the fused CPU AdamW (4-5x faster than foreach).
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
        if mode.endswith("+step-in-backward"):
            manager.attach_optimizer(optimizer)
    step = toy_step(model, optimizer, manager)
    step_ms, peak = measure(step, steps)
    note = stats_note(manager) if manager is not None else ""
    if PROFILE[0]:
        note += f"; {profile_note(step, model, 512, 0, torch.float32)}"  # 512 rows a step, no attention
    if manager is not None:
        manager.remove()
    return Result("toy (optimizer offload)", mode, step_ms, peak, note)


def fsdp2_wrap(model: nn.Module, blocks: list[nn.Module]) -> nn.Module:
    """PyTorch FSDP2 with CPUOffloadPolicy on a one-rank process group (the peer baseline)."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    for block in blocks:
        fully_shard(block, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    return model


class LoraLinear(nn.Module):
    """A frozen bf16 projection with a rank-32 trainable adapter."""

    def __init__(self, d_in: int, d_out: int, rank: int = 32) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False, dtype=torch.bfloat16)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False, dtype=torch.bfloat16)
        self.lora_b = nn.Linear(rank, d_out, bias=False, dtype=torch.bfloat16)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoraBlock(nn.Module):
    def __init__(self, d: int, ff: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d, dtype=torch.bfloat16)
        self.norm2 = nn.LayerNorm(d, dtype=torch.bfloat16)
        self.q, self.k, self.v, self.o = (LoraLinear(d, d) for _ in range(4))
        self.up, self.down = LoraLinear(d, ff), LoraLinear(ff, d)
        self.norm1.requires_grad_(False)
        self.norm2.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LoraModel(nn.Module):
    def __init__(self, depth: int = 16, d: int = 4096, ff: int = 16384, heads: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LoraBlock(d, ff, heads) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def make_lora_model() -> LoraModel:
    with torch.device("meta"):
        model = LoraModel()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0 if name.endswith("weight") else 0.0)
        elif "lora_b" in name:
            param.data.zero_()
        else:  # drawn on the GPU: initialising 3.2B values on the CPU would take longer than the benchmark
            param.data.copy_(torch.randn(param.shape, device="cuda", dtype=param.dtype) * 0.02)
    return model


_LORA: dict[str, LoraModel] = {}


def run_lora(mode: str, steps: int, tokens: int, limit: str | None = None) -> Result:
    """One row: ``mode`` at ``tokens`` per step; ``limit`` holds the process to that much device memory
    (``gpu_memory_limit``, set when the manager is created, before any of its device memory)."""
    model = _LORA.setdefault("model", make_lora_model())
    manager = None
    budget = None
    if limit is not None:
        base = MODES[mode][0]
        options = OffloadOptions(prefetch=base.prefetch, granularity=base.granularity, gpu_memory_limit=limit)
        manager = OffloadTrainingManager(model, "cuda", options=options)
    elif mode == "resident":
        model.to("cuda")
    elif mode == "fsdp2":
        import copy

        model = copy.deepcopy(model)  # FSDP2 takes the model over; the other modes keep the original
        model = fsdp2_wrap(model, list(model.blocks))
    elif mode.startswith("ferry-budget-"):
        budget = {"0": None, "unlimited": 1 << 50}.get(
            mode.removeprefix("ferry-budget-"), mode.removeprefix("ferry-budget-")
        )
        manager = OffloadTrainingManager(model, "cuda", options=OffloadOptions(gpu_memory_budget=budget))
    else:
        manager = OffloadTrainingManager(model, "cuda", options=MODES[mode][0])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = tokens // 4096

    def step() -> None:
        x = torch.randn(batch, 4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        model(x).float().pow(2).mean().backward()
        if manager is not None:
            manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()

    try:
        step_ms, peak = measure(step, steps)
    except torch.OutOfMemoryError:
        step_ms, peak, _LAST_RESERVED[0] = float("nan"), float("nan"), float("nan")
        note = f"out of memory under {limit}"
    else:
        note = stats_note(manager) if manager is not None else ""
        if PROFILE[0]:
            note += f"; {profile_note(step, model, tokens, 4096, torch.bfloat16)}"
    finally:
        if manager is not None:
            manager.remove()  # also lifts the limit
        if mode == "resident":
            model.to("cpu")
    workload = f"lora {tokens} tokens" + (f", limit {limit}" if limit else "")
    return Result(workload, mode, step_ms, peak, note, _LAST_RESERVED[0])


def profile_note(step: Callable[[], None], model: nn.Module, tokens: int, seq_len: int, dtype: torch.dtype) -> str:
    """--profile: two more steps under torch.profiler, reported as a job's ``training.profile`` reports them."""
    from bench.profiled import profile_steps

    return profile_steps(step, model, tokens, seq_len, torch.device("cuda"), dtype)


LORA_WEIGHT_BYTES = 16 * (4 * 4096 * 4096 + 2 * 4096 * 16384) * 2


LORA_MODES = ["resident", *[m for m in MODES if "step-in-backward" not in m], "fsdp2"]
# The comparison table: the reference schedule, FSDP2, Ferry's two granularities, and resident as the baseline.
TABLE_MODES = ["resident", "ferry-prefetch0-leaf (seed)", "fsdp2", "ferry-leaf", "ferry-block"]
LIMITS = [(4096, "2.5GiB"), (4096, "3GiB"), (16384, "6.5GiB"), (16384, "8GiB")]
LIMIT_MODES = ["ferry-prefetch0-leaf (seed)", "ferry-leaf", "ferry-block"]
WORKLOADS: dict[str, tuple[Callable[[str, int], Result], list[str]]] = {
    "toy": (run_toy, ["resident", *MODES, "fsdp2"]),
    "lora4k": (lambda mode, steps: run_lora(mode, steps, 4096), LORA_MODES),
    "lora16k": (lambda mode, steps: run_lora(mode, steps, 16384), LORA_MODES),
    "table4k": (lambda mode, steps: run_lora(mode, steps, 4096), TABLE_MODES),
    "table16k": (lambda mode, steps: run_lora(mode, steps, 16384), TABLE_MODES),
    "limits": (
        lambda mode, steps: run_lora(mode.split("@")[0], steps, int(mode.split("@")[1]), mode.split("@")[2]),
        [f"{m}@{t}@{lim}" for t, lim in LIMITS for m in LIMIT_MODES],
    ),
    "budget": (
        lambda mode, steps: run_lora(mode, steps, 4096),
        [f"ferry-budget-{b}" for b in ("0", "2GiB", "4GiB", "8GiB", "unlimited")],
    ),
}


def commit() -> str:
    if os.environ.get("FERRY_COMMIT"):  # the device's copy of the tree has no .git
        return os.environ["FERRY_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(results: list[Result]) -> str:
    lines = [
        "| workload | mode | median step (ms) | peak allocated (GiB) | peak reserved (GiB) | notes |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.workload} | {r.mode.split('@')[0]} | {r.step_ms:.1f} | {r.peak_gib:.2f} | {r.reserved_gib:.2f} | {r.note} |"
        for r in results
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--write",
        type=Path,
        nargs="?",
        const=RESULTS,
        default=None,
        help="put the table into this file's offload_bench section (default file: bench/RESULTS.md)",
    )
    parser.add_argument("--out", type=Path, help="also write the table's markdown and JSON rows here")
    parser.add_argument("--profile", action="store_true", help="each row's profile: shares of the step, MFU")
    args = parser.parse_args()
    PROFILE[0] = args.profile
    if not torch.cuda.is_available():
        sys.exit("offload_bench needs a CUDA GPU")
    h2d = pinned_h2d_gbps()
    results = []
    for name in args.workloads.split(","):
        runner, modes = WORKLOADS[name]
        for mode in modes:
            try:
                results.append(runner(mode, args.steps))
            except Exception as error:  # a peer that cannot run here is reported, not fatal
                results.append(Result(name, mode, float("nan"), float("nan"), f"failed: {error!r}"[:200]))
            print(table(results[-1:]).splitlines()[-1], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    header = (
        f"{datetime.date.today()} — {torch.cuda.get_device_name()} — "
        f"torch {torch.__version__} — commit {commit()}\n\n"
        f"Pinned host→device copy {h2d:.1f} GB/s; lora transfer floor "
        f"2 × {LORA_WEIGHT_BYTES / 1e9:.2f} GB / H2D = {2 * LORA_WEIGHT_BYTES / h2d / 1e6:.0f} ms.\n\n"
        f"Reproduce: `python bench/offload_bench.py --workloads {args.workloads} --steps {args.steps}"
        f"{' --profile' if args.profile else ''}`\n"
    )
    text = header + "\n" + table(results) + "\n"
    print("\n" + text)
    if args.out is not None:
        import json
        from dataclasses import asdict

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offload_bench.md").write_text(text)
        (args.out / "offload_bench.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.write is not None:
        replace_section(args.write, SECTION, "## Offload engine\n\n" + text, title="Benchmark results")


if __name__ == "__main__":
    main()
