"""Why the compiled NF4 dequantization speeds up a resident LoRA step but slows a streamed one:
one dequantization call's host and device time (torchao eager against compiled), then a 4-block LoRA stack
at 4096 tokens, resident and offloaded, with each form: the step, the host's time to issue it, and the
compiled graphs dynamo made (a recompile or a fallback shows there).

Run on a GPU box:  python bench/nf4_dequant_probe.py   (prints lines; about 40 s after start-up)
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.offload_bench import LoraModel
from bench.offload_bench import timed_steps as measure
from offload import OffloadTrainingManager
from offload.quant.nf4_linear import CompiledNF4Linear, dequantize, is_nf4
from offload.quant.quantized import quantize_frozen_weights


def one_call() -> None:
    from torchao.quantization import to_nf4

    for shape in ((4096, 4096), (16384, 4096)):
        weight = to_nf4(torch.randn(shape, device="cuda", dtype=torch.bfloat16), 64, 256)
        forms = {
            "torchao eager": lambda w=weight: w.to(torch.bfloat16),
            "compiled": lambda w=weight: dequantize(w, torch.bfloat16),
        }
        for name, run in forms.items():
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(100):
                run()
            issued = time.perf_counter()
            torch.cuda.synchronize()
            print(
                f"dequantize {shape}, {name}: host {(issued - start) * 1e4:.0f} us/call, "
                f"host+device {(time.perf_counter() - start) * 1e4:.0f} us/call",
                flush=True,
            )


def small_stack() -> LoraModel:
    with torch.device("meta"):
        model = LoraModel(depth=4)
    model.to_empty(device="cpu")
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0 if name.endswith("weight") else 0.0)
        elif "lora_b" in name:
            param.data.zero_()
        else:
            param.data.copy_(torch.randn(param.shape, device="cuda", dtype=param.dtype) * 0.02)
    quantize_frozen_weights(model, "nf4", device="cuda")
    return model


def lora_step(model: torch.nn.Module, offloaded: bool, compiled: bool) -> None:
    converted = [m for m in model.modules() if type(m) is torch.nn.Linear and is_nf4(m.weight)] if compiled else []
    for layer in converted:
        layer.__class__ = CompiledNF4Linear
    manager = OffloadTrainingManager(model, "cuda") if offloaded else None
    if manager is None:
        model.to("cuda")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    issue = []

    def step() -> None:
        x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        start = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        issue.append(time.perf_counter() - start)  # backward() returns once its work is queued
        if manager is not None:
            manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()

    ms, alloc, reserved = measure(step, 4)
    graphs = dict(torch._dynamo.utils.counters["stats"])
    print(
        f"4-block lora 4096 nf4 {'offloaded' if offloaded else 'resident'}, "
        f"{'compiled' if compiled else 'torchao eager'}: {ms:.1f} ms/step, host issues forward+backward in "
        f"{sorted(issue)[len(issue) // 2] * 1e3:.1f} ms; {alloc:.2f}/{reserved:.2f} GiB; dynamo {graphs}",
        flush=True,
    )
    if manager is not None:
        manager.remove()
    for layer in converted:
        layer.__class__ = torch.nn.Linear


def main() -> None:
    one_call()
    base = small_stack()
    for compiled in (False, True):
        lora_step(copy.deepcopy(base), offloaded=False, compiled=compiled)
        lora_step(base, offloaded=True, compiled=compiled)


if __name__ == "__main__":
    main()
