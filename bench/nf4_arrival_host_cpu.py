"""Host time of NF4 dequantization on arrival, accounted on the CPU with cProfile.

On the GPU the LoRA step at 4096 tokens is bound by the host: each compiled dequantization call costs dynamo's
guards and wrappers. This runs a small NF4 LoRA stack (bench/offload_bench.py's LoraModel, checkpointed)
with ``target_device="cpu"`` and the *compiled* kernel (``COMPILE_ON_CPU``), and splits each step's host
time into the dequantization calls' own overhead (the compiled wrapper minus the kernel) and the rest.
Rows: leaf units (one weight per unit), block units (a block's six weights in one call per visit) and block
units with one call per weight (each weight in a batch of its own: the engine before ArrivalBatch).

The kernels themselves are CPU loops here, not the GPU's: only the overhead columns carry over.

Run:  python bench/nf4_arrival_host_cpu.py [--steps 5]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.offload_bench import LoraModel
from offload import OffloadOptions, OffloadTrainingManager
from offload.quant import dequantize_on_arrival as arrival
from offload.quant import nf4_dequantize as nf4_kernels
from offload.quant.dequantize_on_arrival import ArrivalBatch, DequantizedParamOffloader
from offload.quant.quantized import quantize_frozen_weights


def make_stack() -> LoraModel:
    torch.manual_seed(0)
    model = LoraModel(depth=4, d=256, ff=1024, heads=4)
    for name, param in model.named_parameters():
        param.requires_grad_("lora" in name)
        if "lora_b" in name:
            param.data.zero_()
    quantize_frozen_weights(model, "nf4")
    return model


def run(mode: str, steps: int) -> str:
    model = make_stack()
    granularity = "leaf" if mode == "leaf units" else "block"
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity=granularity))
    dequantizers = [o for o in manager._offloaders.values() if isinstance(o, DequantizedParamOffloader)]
    if mode == "block units, one call per weight":
        for offloader in dequantizers:
            ArrivalBatch([offloader])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        x = torch.randn(1, 64, 256, dtype=torch.bfloat16, requires_grad=True)
        model(x).float().pow(2).mean().backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # the first step records the order; both compile what they need
        step()
    calls = []
    original = arrival.dequantize_nf4_spans_into
    arrival.dequantize_nf4_spans_into = lambda *a: calls.append(1) or original(*a)  # type: ignore[assignment]
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    wall = (time.perf_counter() - start) / steps * 1e3
    arrival.dequantize_nf4_spans_into = original  # type: ignore[assignment]
    manager.remove()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    wrapper = sum(v[3] for k, v in stats.items() if k[2] == "compile_wrapper") / steps * 1e3
    kernels = sum(v[2] for k, v in stats.items() if k[2] == "kernel" or "kernel.kernel" in k[2]) / steps * 1e3
    per_call = (wrapper - kernels) / max(1, len(calls) / steps) * 1e3
    return f"| {mode} | {len(calls) / steps:.0f} | {wrapper - kernels:.1f} | {per_call:.0f} | {wall:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    nf4_kernels.COMPILE_ON_CPU = True
    torch.set_num_threads(1)  # a shared machine: the kernels' time is subtracted, the rest is one thread
    torch._dynamo.config.cache_size_limit = 64
    lines = [
        f"NF4 dequantization on arrival, host time per step on the CPU (cProfile), torch {torch.__version__}, "
        f"LoraModel(depth=4, d=256, ff=1024), 64 tokens, checkpointed, compiled kernel",
        "",
        "| units | dequantization calls / step | their host overhead (ms / step) | per call (us) "
        "| wall (ms / step, profiled) |",
        "|---|---|---|---|---|",
    ]
    lines += [run(mode, args.steps) for mode in ("leaf units", "block units, one call per weight", "block units")]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
