"""CPU optimizer overlap and quantized frozen weights on one GPU: the CPU optimizer overlapped (exact and
delayed) on the seed's toy model, and LoRA on a 3.2B stack with an NF4 base, offloaded and resident; the
reference (the seed's serialized schedule) and FSDP2 CPU offload beside each row, every mode with the fused
AdamW kernel.

Run on a GPU box:  python bench/optimizer_quant_bench.py [--workloads toy,lora4k,lora16k,kernels] [--steps 6] [--trace DIR]
Prints a table; ``--write`` puts it into bench/RESULTS.md between its markers (the rest of the file stays).
Models and helpers come from bench/offload_bench.py.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.copy_load import BackgroundCopies
from bench.link_rate import pinned_h2d_gbps
from bench.offload_bench import ToyModel, fsdp2_wrap, make_lora_model
from bench.offload_bench import timed_steps as measure
from bench.provenance import commit
from bench.trace_summary import summarize, top_kernels
from offload import OffloadOptions, OffloadTrainingManager
from offload.quant import dequantize_on_arrival
from offload.quant import nf4_dequantize as kernels
from offload.quant.dequantize_on_arrival import ArrivalBatch, DequantizedParamOffloader
from offload.quant.nf4_linear import CompiledNF4Linear, is_nf4
from offload.quant.quantized import quantize_frozen_weights, stored_bytes

RESULTS = Path(__file__).with_name("RESULTS.md")
START, END = "<!-- optimizer_quant_bench:start -->", "<!-- optimizer_quant_bench:end -->"
ROWS: list[str] = []
TRACE_DIR: list[Path] = []  # --trace: where each lora row's profiled steps go


def row(workload: str, mode: str, ms: float, alloc: float, reserved: float, note: str = "") -> None:
    line = f"| {workload} | {mode} | {ms:.1f} | {alloc:.2f} | {reserved:.2f} | {note} |"
    ROWS.append(line)
    print(line, flush=True)


def line_between_rows(line: str) -> None:
    """A line of figures between the table's rows (printed, and kept for RESULTS.md)."""
    ROWS.append(f"\n{line}\n")
    print(line, flush=True)


def fused_or_not(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """FSDP2's CPU-offloaded DTensors with the fused AdamW kernel, or its default kernel if fused refuses them."""
    try:
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
        return optimizer
    except (RuntimeError, ValueError) as error:
        print(f"fsdp2: fused AdamW refused ({error!r:.100}); default kernel", flush=True)
        return torch.optim.AdamW(params, lr=1e-4)


# ---------------------------------------------------------------------------------------------- toy
def toy(
    mode: str, steps: int, losses_for: int = 0, lr: float = 1e-4, threads: int | None = None, warmup: int = 2
) -> list[float]:
    """One toy row (or, with ``losses_for``, the loss curve of that many steps); ``threads``: the CPU
    optimizer worker's intra-op threads (None: the engine's default)."""
    torch.manual_seed(0)
    model = ToyModel()
    manager = None
    if mode == "resident":
        model.to("cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif mode == "fsdp2":
        model = fsdp2_wrap(model, list(model.layers))
        optimizer = fused_or_not(list(model.parameters()))
    else:
        # The seed's schedule copies on every visit: no ring slot reuse (ring.py) in its row.
        seed = OffloadOptions(prefetch=0, reuse_ring_slots=False)
        # ", budget 1GiB": the first layers stay on the GPU with their optimizer (4 bytes of budget per byte of
        # weight: 3 of the 10 layers in 1 GiB, 7 in 2 GiB), what is left holds others from forward to backward.
        budget = _budget_of(mode)
        options = seed if mode == "reference (seed schedule)" else OffloadOptions(gpu_memory_budget=budget)
        manager = OffloadTrainingManager(model, "cuda", enable_optimizer_cpu_offload=True, options=options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        if mode.startswith(("ferry exact", "ferry delayed_update")):
            delayed = mode.startswith("ferry delayed_update")
            manager.attach_optimizer(optimizer, delayed_update=delayed, warmup_steps=warmup, cpu_threads=threads)
    generator = torch.Generator(device="cuda").manual_seed(1)
    timings = {"fwd": [], "bwd": []}

    def step(profile: bool = False) -> float:
        x = torch.randn((512, 4096), device="cuda", generator=generator)
        start = time.perf_counter()
        loss = F.mse_loss(model(x), x + 1)
        if profile:
            torch.cuda.synchronize()
            timings["fwd"].append(time.perf_counter() - start)
        loss.backward()
        if manager is not None:
            manager.after_backward()
        if profile:
            timings["bwd"].append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    if losses_for:
        curve = [float(step().detach()) for _ in range(losses_for)]
        if manager is not None:
            manager.remove()
        return curve
    ms, alloc, reserved = measure(step, steps)
    note = ""
    if manager is not None:
        stepper = manager._stepper
        busy0, wait0, compute0, copy0, calls0 = (
            (
                stepper.busy_seconds,
                stepper.wait_seconds,
                stepper.compute_seconds,
                stepper.copy_seconds,
                stepper.optimizer_calls,
            )
            if stepper
            else (0.0, 0.0, 0.0, 0.0, 0)
        )
        for _ in range(3):
            step(profile=True)
            torch.cuda.synchronize()
        fwd, bwd = statistics.median(timings["fwd"]) * 1e3, statistics.median(timings["bwd"]) * 1e3
        note = f"forward {fwd:.1f} ms, forward+backward+after_backward {bwd:.1f} ms"
        if stepper is not None:
            note += (
                f"; CPU optimizer ({stepper.cpu_threads} threads) busy {(stepper.busy_seconds - busy0) / 3 * 1e3:.1f}"
                f" ms/step (in AdamW {(stepper.compute_seconds - compute0) / 3 * 1e3:.1f}, CPU copies "
                f"{(stepper.copy_seconds - copy0) / 3 * 1e3:.1f}), "
                f"forward waited for it {(stepper.wait_seconds - wait0) / 3 * 1e3:.1f} ms/step, "
                f"{(stepper.optimizer_calls - calls0) / 3:.0f} optimizer calls/step"
            )
        stats = manager.stats()
        note += f"; h2d {stats.last_step_h2d_bytes / 1e9:.2f} GB, d2h {stats.last_step_d2h_bytes / 1e9:.2f} GB/step"
        if manager.plan.device_trainables:
            on_gpu = sum(
                p.numel() * p.element_size() for p in model.parameters() if id(p) in manager.plan.device_trainables
            )
            held = manager._schedule.held_for_backward_bytes
            note += f"; on the GPU with their optimizer {on_gpu / 1e9:.2f} GB of weights, held for backward {held / 1e9:.2f} GB"
        manager.remove()
    row("toy (optimizer offload)", mode if threads is None else f"{mode}, {threads} threads", ms, alloc, reserved, note)
    return []


def cpu_adamw_alone(threads: int | None = None, with_copies: bool = False) -> None:
    """The fused CPU AdamW over the toy's parameters with nothing else running (or with pinned copies both
    ways running on the link meanwhile, as in a step): one call, and per parameter."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    load = BackgroundCopies() if with_copies else None
    torch.manual_seed(0)
    params = [torch.nn.Parameter(p.detach().clone()) for p in ToyModel().parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    whole = torch.optim.AdamW(params, lr=1e-4, fused=True)
    singles = [torch.optim.AdamW([p], lr=1e-4, fused=True) for p in params]
    timings = {"one call": [], "per parameter": []}
    for _ in range(4):
        start = time.perf_counter()
        whole.step()
        timings["one call"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for single in singles:
            single.step()
        timings["per parameter"].append(time.perf_counter() - start)
    if load is not None:
        load.stop()
    line = "fused CPU AdamW over the toy's 168M parameters {} ({} threads): {}".format(
        "while 512 MB pinned copies run each way" if with_copies else "alone",
        torch.get_num_threads(),
        ", ".join(f"{k} {statistics.median(v[1:]) * 1e3:.1f} ms" for k, v in timings.items()),
    )
    torch.set_num_threads(previous)
    line_between_rows(line)


def stale_by_hand(lr: float, warmup: int, steps: int = 100) -> list[float]:
    """The delayed update's schedule as a plain resident loop (no engine): exact for ``warmup`` steps, then
    step s's gradient is applied just before step s+2's forward, so step s+1 runs on the weights before it.
    Its loss against Ferry's delayed_update separates the algorithm's staleness from the engine."""
    torch.manual_seed(0)
    model = ToyModel().to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    held: list[list[torch.Tensor | None]] = []
    curve = []
    for step in range(steps):
        if step >= warmup + 2:
            for param, grad in zip(model.parameters(), held.pop(0), strict=True):
                param.grad = grad
            optimizer.step()
            optimizer.zero_grad()
        x = torch.randn((512, 4096), device="cuda", generator=generator)
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        curve.append(float(loss.detach()))
        if step < warmup:
            optimizer.step()
        else:
            held.append([p.grad for p in model.parameters()])
        optimizer.zero_grad()
    return curve


def toy_losses() -> None:
    """The loss at step 100, exact against delayed_update, at two learning rates and two warm-ups, beside the
    same one-step-stale schedule written as a plain resident loop."""
    for lr in (1e-4, 1e-5):
        exact = toy("ferry exact", 0, losses_for=100, lr=lr)
        for warmup in (2, 10):
            delayed = toy("ferry delayed_update", 0, losses_for=100, lr=lr, warmup=warmup)
            by_hand = stale_by_hand(lr, warmup)
            gap = abs(delayed[-1] - exact[-1]) / exact[-1] * 100
            hand_gap = abs(by_hand[-1] - exact[-1]) / exact[-1] * 100
            line = (
                f"lr {lr:g}: loss at step 1 {exact[0]:.4f}; at step 100 exact {exact[-1]:.5f}, "
                f"delayed_update (warm-up {warmup}) {delayed[-1]:.5f} ({gap:.2f}% apart); the same stale "
                f"schedule as a plain resident loop {by_hand[-1]:.5f} ({hand_gap:.2f}% apart from exact)"
            )
            line_between_rows(line)


def _budget_of(mode: str) -> str | None:
    """A mode's ``gpu_memory_budget``: the size after ", budget " ("..., budget 2GiB (kept quantized)": 2GiB)."""
    return mode.split(", budget ", 1)[1].split(" ", 1)[0] if ", budget " in mode else None


# ---------------------------------------------------------------------------------------------- lora
_MODELS: dict[str, torch.nn.Module] = {}


def lora_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    if not _MODELS:
        base = make_lora_model()
        quantized = copy.deepcopy(base)
        quantize_frozen_weights(quantized, "nf4", device="cuda")  # torchao's kernels on the GPU: seconds
        _MODELS.update(bf16=base, nf4=quantized)
    return _MODELS["bf16"], _MODELS["nf4"]


def lora(mode: str, steps: int, tokens: int) -> None:
    bf16, nf4 = lora_models()
    model, manager = (nf4 if mode.startswith("nf4") else bf16), None
    compiled = mode.endswith("(compiled dequantization)")
    # As quantize_frozen_weights(..., compile_dequantization=True) leaves them (the other modes: torchao's layer).
    converted = [m for m in model.modules() if type(m) is torch.nn.Linear and is_nf4(m.weight)] if compiled else []
    for layer in converted:
        layer.__class__ = CompiledNF4Linear
    kernels.COMPILE_ON_CUDA = "eager kernel" not in mode
    kernels.GRAPHS_ON_CUDA = "no dequantization graphs" not in mode
    # ", budget 2GiB": blocks kept on the GPU for good, dequantized once (their bf16 form is what the budget
    # counts); "(kept quantized)": as before, torchao's NF4 tensor kept, dequantized inside the layer per call.
    dequantize_on_arrival.KEEP_DEQUANTIZED = "kept quantized" not in mode
    budget = _budget_of(mode)
    if "no index asserts" in mode:  # the nibbles index a 16-entry table: always in bounds
        kernels.COMPILE_OPTIONS["assert_indirect_indexing"] = False
        kernels.forget_compiled_kernels()
    if mode.startswith(("nf4 resident", "bf16 resident")):
        model.to("cuda")
    elif mode == "fsdp2 (bf16)":
        model = copy.deepcopy(bf16)  # FSDP2 takes the model over; the other modes keep the original
        model = fsdp2_wrap(model, list(model.blocks))
    elif mode == "reference (seed schedule, bf16)":
        options = OffloadOptions(prefetch=0, reuse_ring_slots=False)  # the seed copies on every visit
        manager = OffloadTrainingManager(model, "cuda", options=options)
    else:
        options = OffloadOptions(
            prefetch=2 if "prefetch 2" in mode else 1,
            granularity="block" if "block units" in mode else "leaf",
            dequantize_on_arrival="torchao in the layer" not in mode,
            reuse_ring_slots="no slot reuse" not in mode,
            gpu_memory_budget=budget,
        )
        manager = OffloadTrainingManager(model, "cuda", options=options)
        if "one call per weight" in mode:  # each weight in a batch of its own: the engine before ArrivalBatch
            for offloader in manager._offloaders.values():
                if isinstance(offloader, DequantizedParamOffloader):
                    ArrivalBatch([offloader])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = (
        fused_or_not(trainable) if mode.startswith("fsdp2") else torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    )

    def step() -> None:
        x = torch.randn(tokens // 4096, 4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        model(x).float().pow(2).mean().backward()
        if manager is not None:
            manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()

    # The resident step while the link carries copies it does not make: what the copies alone cost a step
    # that the host bounds (bench/copy_load.py), beside the engine's own host work in the offloaded rows.
    load = BackgroundCopies(directions=("h2d",)) if "background copies" in mode else None
    try:
        ms, alloc, reserved = measure(step, steps)
    finally:
        if load is not None:
            load.stop()
    if TRACE_DIR:
        profile_steps(step, TRACE_DIR[0] / f"lora{tokens}-{mode.replace(' ', '_').replace(',', '')}.json", mode)
    note = load.describe() if load is not None else ""
    if manager is not None:
        stats = manager.stats()
        note = (
            f"h2d {stats.last_step_h2d_bytes / 1e9:.2f} GB/step at {stats.last_step_h2d_gbps:.0f} GB/s "
            f"({stats.reused_bytes / (steps + 2) / 1e9:.2f} GB/step reused from the ring), "
            f"pinned {stats.pinned_reserved_bytes / 2**30:.2f} GiB, device ring {manager.plan.ring_bytes / 2**30:.2f} "
            f"GiB (rooms {manager.plan.room_bytes / 2**30:.2f})"
        )
        dequantizers = [o for o in manager._offloaders.values() if isinstance(o, DequantizedParamOffloader)]
        if dequantizers:
            per_step = sum(o.dequantizations for o in dequantizers) / (steps + 2) / len(dequantizers)
            kernel = "compiled" if kernels.COMPILE_ON_CUDA and not kernels._COMPILE_FAILED else "eager"
            failed = f" (compile failed: {kernels._COMPILE_FAILED[0]!r:.80})" if kernels._COMPILE_FAILED else ""
            batches = {id(o.batch): o.batch for o in dequantizers if o.batch is not None}.values()
            calls = sum(b.calls for b in batches) / (steps + 2)
            note += f"; dequantized on arrival {per_step:.2f}x per weight and step in {calls:.0f} calls, {kernel} kernel{failed}"
            graphs = kernels._SLOT_GRAPHS
            if kernels.GRAPHS_ON_CUDA:
                capture_failed = f" (capture failed: {graphs.failed[0]!r:.80})" if graphs.failed else ""
                note += f", {graphs.replays} CUDA graph replays in all{capture_failed}"
        manager.remove()
    if mode.startswith(("nf4 resident", "bf16 resident")):
        model.to("cpu")
    for layer in converted:
        layer.__class__ = torch.nn.Linear
    kernels.COMPILE_ON_CUDA = kernels.GRAPHS_ON_CUDA = True
    if kernels.COMPILE_OPTIONS.pop("assert_indirect_indexing", None) is not None:
        kernels.forget_compiled_kernels()
    row(f"lora {tokens} tokens", mode, ms, alloc, reserved, note)


def profile_steps(step: Callable[[], None], path: Path, mode: str, count: int = 2) -> None:
    """``count`` steps under torch.profiler: the chrome trace to ``path``, and printed, where each stream's time
    went and the kernels that took the most of it (the device's view of the row's step time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(count):
            step()
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    print(f"PROFILE {mode}, {count} steps:\n{summarize(trace)}\n{top_kernels(trace)}", flush=True)


def dequantize_kernels() -> None:
    """One NF4 dequantization per call, host time to issue it and host+device time: torchao eager against
    the kernel that dequantizes on arrival (compiled, with and without inductor's index asserts)."""
    from torchao.quantization import to_nf4

    from offload.quant.quantized import QuantizedPayload

    for shape in ((4096, 4096), (16384, 4096)):
        nf4 = to_nf4(torch.randn(shape, device="cuda", dtype=torch.bfloat16), 64, 256)
        buffer = torch.empty(stored_bytes(nf4), dtype=torch.uint8, device="cuda")
        inner = QuantizedPayload(nf4, buffer).views(buffer)
        out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        blocks = (nf4.block_size, nf4.scaler_block_size)
        asserts = kernels._compiled()  # the engine's own
        fast = torch.compile(
            kernels._eager(),
            fullgraph=True,
            dynamic=False,
            options={**kernels.COMPILE_OPTIONS, "assert_indirect_indexing": False},
        )
        args = ([out], [inner], ((nf4.shape, nf4.dtype, blocks),))
        forms = {
            "torchao eager (NF4Tensor.to)": functools.partial(nf4.to, torch.bfloat16),
            "on arrival, eager": functools.partial(kernels._eager(), *args),
            "on arrival, compiled": functools.partial(asserts, *args),
            "on arrival, compiled, no index asserts": functools.partial(fast, *args),
        }
        for name, run in forms.items():
            host, total = per_call_us(run)
            line = f"dequantize {shape[0]}x{shape[1]}, {name}: host {host:.0f} us/call, host+device {total:.0f} us/call"
            line_between_rows(line)


def block_dequantization() -> None:
    """One block's six NF4 weights (the lora stack's shapes) dequantized from a ring slot into its room in one
    call, as a unit's visit makes it: host time, device time, kernels per call. The engine's kernel against
    the one it replaced (torchao's ``get_original_weight`` written into slices of the room, one graph)."""
    from torchao.quantization import to_nf4
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    from offload.quant.quantized import aligned

    torch.manual_seed(0)
    d, ff = 4096, 16384
    nf4s = [
        to_nf4(torch.randn(s, device="cuda", dtype=torch.bfloat16), 64, 256) for s in [(d, d)] * 4 + [(ff, d), (d, ff)]
    ]
    slot = torch.empty(sum(aligned(stored_bytes(t)) for t in nf4s), dtype=torch.uint8, device="cuda")
    room = torch.empty(sum(t.numel() for t in nf4s), dtype=torch.bfloat16, device="cuda")
    layout = kernels.pack_nf4_into(slot, nf4s)
    dtypes, weights = layout
    starts = [0, *itertools.accumulate(t.numel() for t in nf4s)]  # each weight's room, one after another
    rooms = tuple(room[a:b] for a, b in itertools.pairwise(starts))
    typed = tuple(slot.view(dtype) for dtype in dtypes)
    expected = torch.cat([t.get_original_weight().reshape(-1) for t in nf4s])

    def before(room: torch.Tensor, payloads: tuple[torch.Tensor, ...]) -> None:  # the engine's kernel until 2026-12-01
        for start, (parts, (shape, dtype, blocks)) in zip(starts, weights, strict=False):
            inner = {name: payloads[i][o : o + n].view(size) for name, i, o, n, size in parts}
            out = room[start : start + shape.numel()].view(shape)
            out.copy_(NF4Tensor.get_original_weight(_Parts(inner, shape, dtype, blocks)))

    old = torch.compile(before, fullgraph=True, dynamic=False, options=dict(kernels.COMPILE_OPTIONS))

    side = torch.cuda.Stream()  # the engine's copy stream (graphs are captured on a side stream only)

    def engine(graphs: bool) -> Callable[[], None]:
        def run() -> None:
            kernels.GRAPHS_ON_CUDA = graphs
            try:
                with torch.cuda.stream(side):
                    kernels.dequantize_nf4_spans_into(rooms, slot, layout)
            finally:
                kernels.GRAPHS_ON_CUDA = True

        return run

    forms = {
        "engine, replayed as a CUDA graph (SlotGraphs)": engine(True),
        "engine, the compiled call (one pointwise kernel per weight, its own room)": engine(False),
        "before (torchao's get_original_weight into slices of one room)": lambda: old(room, typed),
    }
    for name, run in forms.items():
        run()  # compiles; a graph is captured on a slot's second call
        room.zero_()
        run()
        equal = torch.equal(room, expected)
        host, total = per_call_us(run)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for _ in range(10):
                run()
            torch.cuda.synchronize()
        launched = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        device = sum(e.device_time for e in launched) / 10
        line = (
            f"dequantize a block (6 weights, 201M values) into its room, {name}: host {host:.0f} us/call, "
            f"host+device {total:.0f} us/call, device {device:.0f} us/call in {len(launched) / 10:.0f} kernels; "
            f"torchao's values bit for bit: {equal}"
        )
        line_between_rows(line)


class _Parts:
    """The attributes torchao's ``NF4Tensor.get_original_weight`` reads, over plain inner tensors."""

    def __init__(self, inner: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype, blocks: tuple) -> None:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

        self.quantized_data, self.nf4 = inner["quantized_data"], inner["nf4"]
        self.quantized_scalers, self.quantization_factor = inner["quantized_scalers"], inner["quantization_factor"]
        self.scaler_mean, self.shape, self.dtype = inner["scaler_mean"], shape, dtype
        self.block_size, self.scaler_block_size = blocks
        self.dequantize, self._scalers = NF4Tensor.dequantize, NF4Tensor.dequantize_scalers

    def dequantize_scalers(self, *args: object) -> torch.Tensor:
        return self._scalers(self, *args)


def per_call_us(run: Callable[[], object], calls: int = 50) -> tuple[float, float]:
    """Microseconds per call: to issue it, and to issue and finish it."""
    with torch.no_grad():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        issued = time.perf_counter()
        torch.cuda.synchronize()
    return (issued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


LORA_MODES = [
    "reference (seed schedule, bf16)",
    "fsdp2 (bf16)",
    "bf16 resident",
    "bf16 resident, link busy (background copies)",  # the copies' cost apart from the engine's (copy_load.py)
    "nf4 resident",
    "nf4 resident (compiled dequantization)",
    "nf4 offloaded",  # the default: dequantized on arrival, compiled kernel
    "nf4 offloaded (dequantize on arrival, eager kernel)",
    "nf4 offloaded, prefetch 2",
    "nf4 offloaded, block units",
    "nf4 offloaded, block units (no dequantization graphs)",  # the compiled call each visit: SlotGraphs' baseline
    "nf4 offloaded, block units (no slot reuse)",  # every visit copies and dequantizes: the reuse's baseline
    "nf4 offloaded, block units, one call per weight",  # as before ArrivalBatch: the same-run baseline
    "nf4 offloaded, block units, prefetch 2",
    "nf4 offloaded, block units, budget 2GiB",  # 5 of the 16 blocks kept, dequantized once
    "nf4 offloaded, block units, budget 3GiB",  # 7 of them
    "nf4 offloaded, block units, budget 4GiB",  # 10 of them
    "nf4 offloaded, block units, budget 2GiB (kept quantized)",  # the same budget's NF4 units as before
    "nf4 offloaded (no index asserts)",
    "nf4 offloaded, block units (no index asserts)",
    "nf4 offloaded, block units, prefetch 2 (no index asserts)",
    "nf4 offloaded (torchao in the layer)",  # dequantize_on_arrival=False: the default before
]
TOY_MODES = [
    "resident",
    "reference (seed schedule)",
    "fsdp2",
    "ferry default",
    "ferry exact",
    "ferry delayed_update",
    "ferry exact, budget 1GiB",
    "ferry delayed_update, budget 1GiB",
    "ferry exact, budget 2GiB",
    "ferry delayed_update, budget 2GiB",
]


def _arguments(args: argparse.Namespace) -> str:
    """This run's command-line arguments, without where it wrote."""
    line = f"--workloads {args.workloads} --steps {args.steps}"
    line += f" --modes '{args.modes}'" if args.modes else ""
    line += f" --worker-threads {args.worker_threads}" if args.worker_threads else ""
    return line + (" --skip-losses" if args.skip_losses else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default="toy,lora4k,lora16k")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--write", type=Path, default=None, help="a RESULTS.md to update between the markers")
    parser.add_argument("--skip-losses", action="store_true", help="toy: no 100-step loss curves")
    parser.add_argument("--modes", default="", help="lora: only these modes (names separated by ;)")
    parser.add_argument(
        "--worker-threads", default="", help="extra toy rows with these CPU optimizer thread counts, e.g. 16,14,12"
    )
    parser.add_argument("--trace", type=Path, default=None, help="lora: profile two steps of each row, traces here")
    args = parser.parse_args()
    TRACE_DIR.extend([args.trace] if args.trace else [])
    if not torch.cuda.is_available():
        sys.exit("optimizer_quant_bench needs a CUDA GPU")
    # The kernel variants compile the one dequantization function under several options (a graph per
    # shape each): more than dynamo's default 8 graphs per function, past which it would run eagerly.
    torch._dynamo.config.cache_size_limit = 64
    h2d = pinned_h2d_gbps()
    for name in args.workloads.split(","):
        if name == "kernels":
            runs = [dequantize_kernels, block_dequantization]
        elif name == "toy":
            threads = [int(t) for t in args.worker_threads.split(",") if t]
            runs = [lambda m=m: toy(m, args.steps) for m in TOY_MODES]
            runs += [
                lambda m=m, t=t: toy(m, args.steps, threads=t)
                for t in threads
                for m in ("ferry exact", "ferry delayed_update")
            ]
            runs += [] if args.skip_losses else [toy_losses]
            runs += [cpu_adamw_alone, lambda: cpu_adamw_alone(with_copies=True)]
            runs += [lambda t=t: cpu_adamw_alone(threads=t, with_copies=True) for t in threads]
        else:
            tokens = {"lora4k": 4096, "lora16k": 16384}[name]
            modes = [m for m in LORA_MODES if not args.modes or m in args.modes.split(";")]
            runs = [lambda m=m, t=tokens: lora(m, args.steps, t) for m in modes]
        for run in runs:
            try:
                run()
            except Exception as error:  # a peer that cannot run here is reported, not fatal
                ROWS.append(f"| {name} | failed | | | | {error!r:.200} |")
                print(ROWS[-1], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    nf4_bytes = sum(stored_bytes(p) for p in _MODELS["nf4"].parameters()) if _MODELS else 0
    text = "\n".join(
        [
            f"{datetime.date.today()} — {torch.cuda.get_device_name()} — torch {torch.__version__} — commit {commit()}",
            "",
            f"Pinned host→device copy {h2d:.1f} GB/s in this run; the lora stack's NF4 weights are "
            f"{nf4_bytes / 1e9:.2f} GB (bf16: 6.44 GB), so its NF4 copy floor is 2 × {nf4_bytes / 1e9:.2f} GB / H2D = "
            f"{2 * nf4_bytes / h2d / 1e6:.0f} ms.",
            "",
            f"Reproduce: `python bench/optimizer_quant_bench.py {_arguments(args)}`",
            "",
            "| workload | mode | median step (ms) | peak allocated (GiB) | peak reserved (GiB) | notes |",
            "|---|---|---|---|---|---|",
            *ROWS,
        ]
    )
    print("\n" + text)
    if args.write is not None:
        old = args.write.read_text() if args.write.exists() else ""
        block = f"{START}\n## CPU optimizer overlap and quantized frozen weights\n\n{text}\n{END}"
        if START in old:
            old = old[: old.index(START)] + block + old[old.index(END) + len(END) :]
        else:
            old = old.rstrip() + "\n\n" + block + "\n"
        args.write.write_text(old)


if __name__ == "__main__":
    main()
