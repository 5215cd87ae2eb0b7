"""Profile one training step of a DiT of bench/diffusion_bench.py's shapes (Qwen-Image by default, shortened to
``--layers``; Flux.1 or Flux.2 with ``--family``, the LoRA of the family's config) as a real job: step times,
memory, bytes copied, and with ``--trace`` a torch.profiler trace of one step with a summary of where the compute
stream and the copy stream sit idle.

Run on a GPU box:  python bench/diffusion_profile.py --layers 12 --budget 2GiB [--prefetch 1] [--trace t.json.gz]
                   python bench/diffusion_profile.py --layers 12 --resident
                   python bench/diffusion_profile.py --family flux2 --budget auto --quantize int8 --trace f2.json.gz
                   (Flux.2's whole shape under 24GiB, frozen weights in int8: where its 0.23 s above resident go)
Prints one JSON line of figures (and the trace summary). Per step beside its time: ``issue_s``, the host's time
inside ``train_step`` (queueing forward, backward and the optimizer; close to the step time when the host is
what bounds it), ``gc_ms`` and ``gen2`` (the garbage collector's pauses in the step), ``copy_wait_s`` (the
compute stream's waits for copies, one step late), and the allocator's retries and device mallocs (a cache
flushed near ``gpu_memory_limit`` synchronizes the device). What the host's main thread did inside
``train_step``: ``on_cpu_s`` and ``runnable_s`` (from /proc/thread-self/schedstat: time on a core, and time
ready to run but waiting for one: other work on the machine took its core), ``preempted`` (involuntary context
switches), ``process_cpu_s`` (every thread of the process), and ``cpu_mhz`` (the mean clock of the cores the
process may run on, read after the step): a slow host-bound step is slow for one of these reasons, or because
each call took longer on the same core (``on_cpu_s`` grows with the step). ``full_gc_ms``: one full collection over the
job's objects with none frozen, timed after the last step (what a full collection costs without the
runner's ``gc.freeze``). Nothing is written to bench/RESULTS.md: the numbers
recorded there come from bench/diffusion_bench.py.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

# The tree the caller's PYTHONPATH names comes first (an A/B run points it at another checkout's engine).
sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.diffusion_bench import FAMILIES, dit_job, make_pipeline_dir, write_synthetic_cache
from bench.trace_summary import summarize
from jobs import PathRoots, load_job_spec, run_job
from jobs.events import event_to_wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen_image", choices=sorted(FAMILIES))
    parser.add_argument(
        "--layers", type=int, default=None, help="the DiT's num_layers (Qwen-Image: 12; Flux: the family's)"
    )
    parser.add_argument("--single-layers", type=int, default=None, help="Flux: num_single_layers (the family's)")
    parser.add_argument("--quantize", default=None, choices=["nf4", "int8"], help="model.quantize")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget", default=None, help="offload.gpu_memory_budget")
    parser.add_argument("--limit", default="24GiB", help="offload.gpu_memory_limit")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--granularity", default="block")
    parser.add_argument("--resident", action="store_true", help="no offload, no limit")
    parser.add_argument("--trace", default=None, help="write a chrome trace (.json.gz) of the last step here")
    parser.add_argument("--trace-cpu", action="store_true", help="trace host ops too (a large trace at 60 layers)")
    parser.add_argument(
        "--full-mask",
        action="store_true",
        help="pass the prompt mask even where no prompt is padded (the DiT then runs its masked attention)",
    )
    parser.add_argument("--label", default="")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    args = parser.parse_args()
    if args.full_mask:  # the A/B of jobs/models/diffusion/batches.padded_mask: every batch keeps its mask
        import jobs.models.diffusion.data.batches

        jobs.models.diffusion.data.batches.padded_mask = lambda mask: mask  # type: ignore[assignment]
    work = Path(tempfile.mkdtemp(prefix="ferry-dit-profile-"))
    models, data = work / "models", work / "data"
    data.mkdir(parents=True)
    device, side = ("cpu", 64) if args.tiny else ("cuda", 1024)
    bench = FAMILIES[args.family]
    pipeline = make_pipeline_dir(models / "dit", tiny=args.tiny, family=args.family)
    config_path = pipeline / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    layers = args.layers or (12 if args.family == "qwen_image" else None)
    shortened = {"num_layers": layers, "num_single_layers": args.single_layers}
    config_path.write_text(json.dumps({**config, **{k: v for k, v in shortened.items() if v is not None}}))
    dim = config["joint_attention_dim"]
    prompt_tokens = 64 if args.tiny else bench.prompt_tokens  # as diffusion_bench's rows
    write_synthetic_cache(data / "dit-cache", pipeline, samples=4, side=side, prompt_tokens=prompt_tokens, dim=dim)
    offload: dict[str, Any] = (
        {}
        if args.resident
        else {
            "enable_model_cpu_offload": True,
            "granularity": args.granularity,
            "prefetch": args.prefetch,
            **({} if args.tiny else {"gpu_memory_limit": args.limit}),
            "gpu_memory_budget": args.budget or None,  # unset: every unit streamed
        }
    )
    model = {"quantize": args.quantize} if args.quantize else None
    spec = dit_job("profile", "dit", steps=args.steps, device=device, offload=offload, model=model, lora=bench.lora())
    roots = PathRoots(model_roots=[models], data_roots=[data])
    events: list[dict[str, Any]] = []
    profiler: list[torch.profiler.profile] = []
    probe = StepProbe(device)

    def report(event: Any) -> None:
        wire = event_to_wire(event)
        events.append(wire)
        if wire["type"] != "step":
            return
        probe.step_ended(wire, last=wire["step"] == args.steps)
        if not args.trace:
            return
        if wire["step"] == args.steps - 1:  # the last step, from the runner's point of view: event to event
            cuda = device == "cuda"
            activities = [torch.profiler.ProfilerActivity.CUDA] if cuda else []
            activities += [torch.profiler.ProfilerActivity.CPU] if args.trace_cpu or not cuda else []
            profiler.append(torch.profiler.profile(activities=activities))
            profiler[0].__enter__()
        elif wire["step"] == args.steps:
            profiler[0].__exit__(None, None, None)

    started = time.perf_counter()
    run_job(load_job_spec(yaml.safe_dump(spec), roots), output_dir=work / "out", report=report)
    steps = [e for e in events if e["type"] == "step"]
    seconds = [1 / e["samples_per_s"] for e in steps]
    figures = {
        "label": args.label,
        "family": args.family,
        "layers": layers,
        "single_layers": args.single_layers,
        "quantize": args.quantize,
        "offload": offload,
        "step_s": [round(s, 4) for s in seconds],
        "median_after_first_s": round(statistics.median(seconds[1:]), 4),
        "peak_alloc_gib": round(max(e["device_peak_bytes"] for e in steps) / 2**30, 2),
        "peak_reserved_gib": round(max(e["device_reserved_bytes"] for e in steps) / 2**30, 2),
        "h2d_gb": round(((steps[-1].get("offload") or {}).get("last_step_h2d_bytes") or 0) / 1e9, 2),
        "job_s": round(time.perf_counter() - started, 1),
        **probe.figures(),
    }
    print("FIGURES", json.dumps(figures), flush=True)
    if profiler:
        raw = work / "trace.json"
        profiler[0].export_chrome_trace(str(raw))
        print(summarize(json.loads(raw.read_text())), flush=True)
        with open(raw, "rb") as source, gzip.open(args.trace, "wb") as target:
            target.write(source.read())
        print(profiler[0].key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


class StepProbe:
    """Per-step host and allocator figures, gathered around ``jobs.train.runner.train_step`` and the step events."""

    def __init__(self, device: str) -> None:
        import jobs.train.runner

        self.cuda = device == "cuda"
        self.rows: dict[str, list[float]] = {k: [] for k in ("issue_s", "gc_ms", "gen2", "copy_wait_s")}
        self.rows.update({k: [] for k in ("alloc_retries", "device_mallocs", "device_frees")})
        self.rows.update({k: [] for k in ("on_cpu_s", "runnable_s", "preempted", "process_cpu_s", "cpu_mhz")})
        self.full_gc_ms = 0.0
        self._gc = [0.0, 0]  # pause seconds and full collections since the last step event
        self._gc_start = 0.0
        self._copy_wait = 0.0
        self._memory = self._memory_counts()
        gc.callbacks.append(self._on_gc)
        step = jobs.train.runner.train_step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            host = host_counters()
            begun = time.perf_counter()
            loss = step(*args, **kwargs)
            self.rows["issue_s"].append(round(time.perf_counter() - begun, 4))
            for key, now, before in zip(
                ("on_cpu_s", "runnable_s", "preempted", "process_cpu_s"), host_counters(), host, strict=True
            ):
                self.rows[key].append(round(now - before, 4))
            self.rows["cpu_mhz"].append(mean_cpu_mhz())
            return loss

        jobs.train.runner.train_step = timed_step  # type: ignore[assignment]

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        self._gc[0] += time.perf_counter() - self._gc_start
        self._gc[1] += info["generation"] == 2

    def _memory_counts(self) -> tuple[int, int, int]:
        if not self.cuda:
            return (0, 0, 0)
        stats = torch.cuda.memory_stats()
        return (stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0), stats.get("num_device_free", 0))

    def step_ended(self, wire: dict[str, Any], *, last: bool) -> None:
        self.rows["gc_ms"].append(round(self._gc[0] * 1e3, 1))
        self.rows["gen2"].append(self._gc[1])
        self._gc = [0.0, 0]
        waited = (wire.get("offload") or {}).get("copy_wait_seconds", 0.0)
        self.rows["copy_wait_s"].append(round(waited - self._copy_wait, 4))
        self._copy_wait = waited
        memory = self._memory_counts()
        for key, now, before in zip(
            ("alloc_retries", "device_mallocs", "device_frees"), memory, self._memory, strict=True
        ):
            self.rows[key].append(now - before)
        self._memory = memory
        if last:  # outside any timed step: the job is done with its steps
            frozen = gc.get_freeze_count()
            gc.unfreeze()
            begun = time.perf_counter()
            gc.collect()
            self.full_gc_ms = round((time.perf_counter() - begun) * 1e3, 1)
            if frozen:
                gc.freeze()
            self.rows["frozen_objects"] = [frozen]

    def figures(self) -> dict[str, Any]:
        return {**self.rows, "full_gc_ms": self.full_gc_ms}


def host_counters() -> tuple[float, float, int, float]:
    """The calling thread's time on a core and time runnable but waiting (seconds; 0 where the kernel keeps no
    schedstat), its involuntary context switches, and the whole process's CPU time."""
    try:
        on_cpu, waiting, _ = (int(v) for v in Path("/proc/thread-self/schedstat").read_text().split())
    except (OSError, ValueError):
        on_cpu = waiting = 0
    switches = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_nivcsw
    return on_cpu / 1e9, waiting / 1e9, switches, time.process_time()


def mean_cpu_mhz() -> float:
    """The mean current clock of the cores this process may run on (0 where cpufreq is not exposed)."""
    clocks = []
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            clocks.append(int(Path(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq").read_text()) / 1e3)
        except (OSError, ValueError):
            continue
    return round(statistics.mean(clocks), 0) if clocks else 0.0


if __name__ == "__main__":
    main()
