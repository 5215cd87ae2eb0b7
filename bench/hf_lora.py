"""offload_bench's transformers rows: LoRA on a 3.2B Llama, Ferry's job beside plain transformers + peft resident.

The shape: Llama-2-7B's decoder layer (hidden 4096, MLP 11008, 32 heads) 16 times, 3.24B weights in the layers, a
32000-token vocabulary (tied). LoRA rank 16 on every projection, gradient checkpointing on both sides, bf16
weights, one sequence a step, AdamW on the adapters.

- ``plain``: ``AutoModelForCausalLM`` on the GPU, ``gradient_checkpointing_enable()``, peft's ``get_peft_model``,
  ``model(input_ids, labels).loss.backward()``: what a user writes without Ferry.
- ``ferry-default``: the job (``run_job`` in this process) with model offload on and every other setting at its
  default (``gpu_memory_budget: auto``).
- ``ferry-liger-compile``: the same with ``training.kernels: liger``, ``training.compile: true`` and
  ``offload.granularity: block`` (compiled blocks need block units).
- ``ferry-6GiB`` / ``ferry-6GiB-liger-compile``: under ``offload.gpu_memory_limit: 6GiB``.

A Ferry row's step is the median gap between step events after the first two (compile, the auto budget's
measurement) and after the profiled ones (``--profile``); the plain row's is ``timed_steps``'s. ``--cpu --scale``
runs the same code on a tiny shape on the CPU (compiled with ``aot_eager``: inductor's code generation takes minutes
on a small CPU; Liger needs CUDA, so its rows say so and run plain).
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LLAMA_3B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "tie_word_embeddings": True}  # fmt: skip
TINY = {**LLAMA_3B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 512}  # fmt: skip
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = {"hf4k": 4096, "hf16k": 16384}
PLAIN_MS: dict[int, float] = {}  # tokens -> the plain row's step of this run: each Ferry row's baseline


def shape(scale: float) -> dict[str, Any]:
    return LLAMA_3B if scale >= 1 else TINY


def tokens_of(workload: str, scale: float) -> int:
    return TOKENS[workload] if scale >= 1 else TOKENS[workload] // 64


def plain_step(tokens: int, steps: int, device: str, scale: float, profile: bool) -> dict[str, Any]:
    """transformers + peft resident: the median step (ms), its peak memory and, with ``profile``, its profile."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in shape(scale).items() if k != "model_type"}
    config = AutoConfig.for_model("llama", **fields, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):  # drawn on the device: 3.2B random values on the CPU would take minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=ALL_LINEAR)).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    ms, peak, reserved = _timed(step, steps, device)
    result = {"step_ms": ms, "peak_gib": peak, "reserved_gib": reserved, "profile": None}
    if profile:
        result["profile"] = profile_steps(step, model, tokens, tokens, torch.device(device), torch.bfloat16)
    return result


def ferry_job(mode: str, tokens: int, steps: int, device: str, scale: float, profile: bool) -> dict[str, Any]:
    """The Ferry job of ``mode`` run to the end in this process: its median step (ms), memory and profile message."""
    import yaml

    from bench.big_models import config_of, corpus
    from jobs import PathRoots, load_job_spec, run_job
    from jobs.events import LogEvent, StepEvent
    from jobs.models import compiled_blocks

    if device == "cpu":
        compiled_blocks.BACKEND = "aot_eager"  # the same graphs; inductor's code generation takes minutes here
    root = Path(tempfile.mkdtemp(prefix="ferry-hf-lora-"))
    config_of(shape(scale), max_position_embeddings=32768, torch_dtype="bfloat16").save_pretrained(
        root / "models" / "llama-3b-shape"
    )
    corpus(root / "datasets" / "corpus")
    fast = mode.endswith("liger-compile")
    offload: dict[str, Any] = {"enable_model_cpu_offload": True}
    if fast:
        offload["granularity"] = "block"
    if "6GiB" in mode:
        offload["gpu_memory_limit"] = "6GiB" if scale >= 1 else "1GiB"
    training = {"steps": steps, "batch_size": 1, "learning_rate": 1e-4, "gradient_checkpointing": True}
    training |= {"profile": profile, **({"kernels": "liger", "compile": True} if fast else {})}
    spec = {
        "name": f"llama-3b-shape-{mode}",
        "device": device,
        "model": {"kind": "hf_causal_lm", "path": "llama-3b-shape", "dtype": "bfloat16", "init": "random"},
        "data": {"kind": "text", "path": "corpus", "seq_len": tokens},
        "lora": {"target_modules": ALL_LINEAR, "rank": 16},
        "training": training,
        "offload": offload,
        "checkpoint": {"save_final": False},
    }
    roots = PathRoots(model_roots=[root / "models"], data_roots=[root / "datasets"])
    events: list[tuple[Any, float]] = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run_job(load_job_spec(yaml.safe_dump(spec), roots=roots), output_dir=root / "out",
            report=lambda e: events.append((e, time.perf_counter())))  # fmt: skip
    arrivals = [(e.step, t) for e, t in events if isinstance(e, StepEvent)]
    skipped = 4 if profile else 2  # compile and the auto budget's measurement; then the profiled steps
    gaps = [(b[1] - a[1]) * 1e3 for a, b in itertools.pairwise(arrivals) if b[0] > skipped]
    last = next(e for e, _ in reversed(events) if isinstance(e, StepEvent))
    messages = [e.message for e, _ in events if isinstance(e, LogEvent)]
    return {
        "step_ms": statistics.median(gaps) if gaps else float("nan"),
        "peak_gib": last.device_peak_bytes / 2**30,
        "reserved_gib": last.device_peak_reserved_bytes / 2**30,
        "profile": next((m for m in messages if m.startswith("profile of step")), None),
        "notes": [m for m in messages if m.startswith(("training.", "offload."))],
    }


def profile_steps(
    step: Any, model: torch.nn.Module, tokens: int, seq_len: int, device: torch.device, dtype: torch.dtype
) -> str:
    """``training.profile``'s report over two more calls of ``step``: its message (shares, TFLOP/s, MFU)."""
    from jobs.reporting.step_profile import StepProfiler, peak_flops, training_flops

    profiler = StepProfiler(device=device, first=1, last=2, flops=lambda t: training_flops(model, t, seq_len),
                            peak=peak_flops(device, dtype))  # fmt: skip
    report = None
    for index in (1, 2):
        profiler.before_step(index)
        step()
        report = profiler.after_step(index, tokens)
    assert report is not None
    return report.message()


def _timed(step: Any, steps: int, device: str, warmup: int = 2) -> tuple[float, float, float]:
    if device == "cuda":
        from bench.offload_bench import timed_steps

        return timed_steps(step, steps, warmup)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), float("nan"), float("nan")
