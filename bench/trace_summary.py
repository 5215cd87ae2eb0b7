"""Where a profiled step's device time went, from a torch.profiler chrome trace: each stream's busy time and
idle gaps, the host's sync calls, and the kernels that took the most device time. Used by the benches'
``--trace`` options (bench/diffusion_profile.py, bench/optimizer_quant_bench.py)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def summarize(trace: dict[str, Any]) -> str:
    """Busy time and idle gaps of the compute stream and the host-to-device copy stream; host sync calls."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return "no device activity in the trace"
    streams: dict[Any, list[dict]] = {}
    for e in gpu:
        streams.setdefault((e.get("cat") == "gpu_memcpy", e["args"].get("stream")), []).append(e)
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    lines = [f"window {(end - start) / 1e3:.1f} ms"]
    for (is_copy, stream), items in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        items.sort(key=lambda e: e["ts"])
        busy = sum(e["dur"] for e in items)
        gaps, last = [], start
        for e in items:
            if e["ts"] - last > 50:
                gaps.append((e["ts"] - last, last - start, e["name"][:60]))
            last = max(last, e["ts"] + e["dur"])
        bins = [0.0] * 20
        width = (end - start) / 20
        for e in items:
            for b in range(int((e["ts"] - start) // width), min(19, int((e["ts"] + e["dur"] - start) // width)) + 1):
                lo, hi = start + b * width, start + (b + 1) * width
                bins[b] += max(0.0, min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"]))
        lines.append(
            f"{'copy' if is_copy else 'kernel'} stream {stream}: {len(items)} ops, busy {busy / 1e3:.1f} ms, "
            f"idle gaps >50us: {len(gaps)} totalling {sum(g[0] for g in gaps) / 1e3:.1f} ms; "
            f"busy % per 1/20 of the window: {[round(100 * b / width) for b in bins]}"
        )
        for gap, at, name in sorted(gaps, reverse=True)[:8]:
            lines.append(f"    gap {gap / 1e3:.2f} ms at {at / 1e3:.1f} ms, before {name}")
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    for word in ("Synchronize", "cudaMalloc", "cudaFree", "cudaMemcpy", "cudaHostAlloc", "cudaEventQuery"):
        hits = [e for e in runtime if word in e["name"]]
        if hits:
            lines.append(f"host {word}: {len(hits)} calls, {sum(e['dur'] for e in hits) / 1e3:.2f} ms")
    return "\n".join(lines)


def top_kernels(trace: dict[str, Any], count: int = 15) -> str:
    """The kernels with the most device time, per stream: name, calls, total ms."""
    totals: dict[tuple[Any, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            entry = totals[(e["args"].get("stream"), e["name"][:90])]
            entry[0] += 1
            entry[1] += e["dur"]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:count]
    return "\n".join(f"  stream {s}: {n} calls {t / 1e3:8.2f} ms  {name}" for (s, name), (n, t) in ranked)
