"""bench/trace_summary.py reads a torch.profiler chrome trace: each stream's busy time and gaps, host syncs, and
the kernels with the most device time. A small hand-made trace pins what it reports."""

from __future__ import annotations

from bench.trace_summary import summarize, top_kernels


def _op(cat: str, name: str, ts: float, dur: float, stream: int | None = None) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


TRACE = {
    "traceEvents": [
        _op("kernel", "gemm", 0, 400, stream=7),
        _op("kernel", "gemm", 1000, 400, stream=7),  # a 600 us gap before it
        _op("kernel", "dequantize", 1400, 100, stream=7),
        _op("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 1500, stream=20),
        _op("cuda_runtime", "cudaStreamSynchronize", 10, 30),
        _op("cuda_runtime", "cudaStreamSynchronize", 900, 50),
        {"ph": "i", "name": "not a complete event", "ts": 5},
    ]
}


def test_summary_reports_each_streams_busy_time_gaps_and_syncs():
    text = summarize(TRACE)
    assert text.splitlines()[0] == "window 1.5 ms"
    assert "copy stream 20: 1 ops, busy 1.5 ms, idle gaps >50us: 0" in text
    assert "kernel stream 7: 3 ops, busy 0.9 ms, idle gaps >50us: 1 totalling 0.6 ms" in text
    assert "gap 0.60 ms at 0.4 ms, before gemm" in text
    assert "host Synchronize: 2 calls, 0.08 ms" in text


def test_top_kernels_rank_by_device_time_per_stream():
    lines = top_kernels(TRACE).splitlines()
    assert "stream 20: 1 calls     1.50 ms" in lines[0]
    assert "stream 7: 2 calls     0.80 ms  gemm" in lines[1]
    assert lines[2].endswith("dequantize")


def test_a_trace_without_device_activity_says_so():
    assert summarize({"traceEvents": [_op("cuda_runtime", "cudaFree", 0, 5)]}) == "no device activity in the trace"
