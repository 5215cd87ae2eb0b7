"""Models bigger than the card: each run prints its table and writes JSON + markdown to --out.

    python bench/big_models.py headline --out big   # 32B LoRA (Qwen2.5-32B shape, random init) through
                                                    # the service over HTTP, gpu_memory_limit 24GiB
    python bench/big_models.py disk14b --out big    # 14B sharded safetensors written to local disk, then
                                                    # loaded by a LoRA job under 16GiB; disk read rate too
    python bench/big_models.py full3b --out big     # 3B full fine-tune, model + optimizer offload, 16GiB
    python bench/big_models.py qlora70b --out big   # 70B QLoRA (Llama-3.1-70B shape, NF4 quantized as it loads)
                                                    # over HTTP under 24GiB, beside the same job all resident
    python bench/big_models.py resident70b --out big  # its bf16 resident step, from 20 and 40 identical layers
    python bench/big_models.py long32k --out big    # 32B bf16 LoRA at 32768 tokens under 24GiB with activation
                                                    # offload, beside the resident 32k step and the 4096 one
    python bench/big_models.py disk32b --out big    # 32B bf16 LoRA with offload.host_memory_limit 16GiB: frozen
                                                    # weights beyond it read from the safetensors shards on each
                                                    # use, beside `dd iflag=direct` and the same job all in RAM
    python bench/big_models.py disk32b --out big --layers 32 --host-limit 8GiB   # half its layers, the same
                                                    # share from disk, on a disk under ~70 GB
    python bench/big_models.py headline --cpu --scale 0.02 --out big   # the same path, tiny, anywhere
    python bench/big_models.py headline --out big --budget 8GiB --prefetch 2   # the 32B gap's candidates: units
                                                    # kept on the device, a third ring slot (copy floor counts
                                                    # the bytes still streamed)
    python bench/big_models.py qlora70b --out big --profile --kernels liger --compile   # every job with
                                                    # training.profile (its shares of the step and MFU printed),
                                                    # Liger's kernels and compiled blocks

Each figure sits beside its floor measured in the same run: the pinned host->device copy rate (GB/s) gives
the copy floor 2 x weight bytes / H2D; the disk's own read rate (``dd iflag=direct``); a CPU AdamW step.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from link_rate import pinned_h2d_gbps  # noqa: E402 (after sys.path)

GIB = 2**30

QWEN_32B = {"hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
            "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False}  # fmt: skip
QWEN_14B = {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
            "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False}  # fmt: skip
QWEN_3B = {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}  # fmt: skip
LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "tie_word_embeddings": False}  # fmt: skip
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# --profile, --kernels, --compile: training settings every job of the run takes (main fills it)
TRAINING_EXTRA: dict[str, Any] = {}


def scaled(shape: dict[str, Any], scale: float) -> dict[str, Any]:
    """A smaller model of the same family for --cpu checks (layers and widths shrunk)."""
    if scale >= 1:
        return dict(shape)
    heads = 4
    return {**shape, "hidden_size": 64 * heads, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": heads, "num_key_value_heads": 2, "vocab_size": 1024}  # fmt: skip


def config_of(shape: dict[str, Any], **extra: Any) -> Any:
    """The transformers config of ``shape`` (Qwen2 unless it names another ``model_type``)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in shape.items() if k != "model_type"}
    return AutoConfig.for_model(shape.get("model_type", "qwen2"), **fields, **extra)


def write_config(directory: Path, shape: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config_of(shape, max_position_embeddings=32768, torch_dtype="bfloat16").save_pretrained(directory)


def weight_bytes(shape: dict[str, Any]) -> int:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config_of(shape), dtype=torch.bfloat16)
    return sum(p.numel() * 2 for p in model.parameters())


def corpus(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = (REPO / "configs" / "data" / "tiny_corpus.txt").read_text()
    (directory / "corpus.txt").write_text(text * 400)


def lora_spec(
    name: str, model_dir: str, limit: str, steps: int, tokens: int, init: str, device: str, precision: str = "no"
) -> dict:
    return {
        "name": name,
        "device": device,
        "model": {"kind": "hf_causal_lm", "path": model_dir, "dtype": "bfloat16", "init": init},
        "data": {"kind": "text", "path": "corpus", "seq_len": tokens},
        "lora": {"target_modules": ALL_LINEAR, "rank": 16},
        "training": {
            "steps": steps,
            "batch_size": 1,
            "learning_rate": 1e-4,
            "gradient_checkpointing": True,
            "mixed_precision": precision,
            **TRAINING_EXTRA,
        },
        "offload": {
            "enable_model_cpu_offload": True,
            "granularity": "block",
            "gpu_memory_limit": limit,
            "gpu_memory_budget": None,
        },  # streamed: --budget sets one
        "checkpoint": {"save_final": True},
    }


# ---------------------------------------------------------------------------------------------- table 2
def kept_on_device(budget: str, **extra: Any) -> dict[str, Any]:
    """An ``offload`` section that keeps every unit on the device through ``gpu_memory_budget``, with no limit: the
    resident baselines. Not ``offload: {}``: its in-memory build draws a big model's random weights on the CPU
    (65 GB for the 32B, over four minutes on the H200's host) or holds it whole in bf16 before quantizing."""
    return {"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_budget": budget, **extra}


def headline(args: argparse.Namespace) -> dict[str, Any]:
    """The 32B LoRA job submitted as YAML over HTTP with gpu_memory_limit 24GiB, followed to the end."""
    import httpx
    import yaml
    from gpu_e2e import run_job as follow_job
    from gpu_e2e import start_server

    root = args.out / "headline"
    (root / "models").mkdir(parents=True, exist_ok=True)
    shape = scaled(QWEN_32B, args.scale)
    write_config(root / "models" / "qwen2.5-32b-shape", shape)
    corpus(root / "datasets" / "corpus")
    h2d = pinned_h2d_gbps()
    tokens = 4096 if args.scale >= 1 else 64
    spec = lora_spec("qwen32b-shape-lora", "qwen2.5-32b-shape", args.limit or "24GiB", args.steps, tokens,
                     "random", "cpu" if args.cpu else "cuda", args.mixed_precision)  # fmt: skip
    if args.budget:
        spec["offload"]["gpu_memory_budget"] = args.budget
    if args.prefetch is not None:
        spec["offload"]["prefetch"] = args.prefetch
    if args.whole_layers:
        spec["model"]["uncheckpointed_layers"] = args.whole_layers
    text = yaml.safe_dump(spec, sort_keys=False)
    resident = None
    server, url = start_server(root, "bench-token", {})
    try:
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer bench-token"}, timeout=60) as client:
            validation = client.post("/v1/jobs/validate", content=text, headers={"Content-Type": "application/yaml"})
            job = follow_job(client, "32B LoRA, random init, gpu_memory_limit 24GiB", text, timeout=args.timeout)
            events = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
            if args.resident:
                # The GPU's own step: every unit kept on the device, no limit.
                kept = copy.deepcopy(spec)
                kept["name"] = "qwen32b-shape-lora-resident"
                kept["offload"] = kept_on_device("64GiB")
                resident = follow_job(client, "32B LoRA, every unit kept, no limit", yaml.safe_dump(kept, sort_keys=False),
                                      timeout=args.timeout)  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)
    started = next((e["data"] for e in events if e["type"] == "started"), {})
    weights = weight_bytes(shape)
    offload = job.get("offload") or {}
    record = {
        "job": job,
        "spec": text,
        "estimate": validation.json().get("estimate") if validation.status_code == 200 else validation.text,
        "load": started.get("load"),
        "weight_bytes": weights,
        "h2d_gbps": h2d,
        "copy_floor_s": 2 * weights / (h2d * 1e9) if h2d == h2d else None,
        # What is still streamed once gpu_memory_budget keeps units on the device: each pass copies the rest.
        "streamed_floor_s": 2 * (weights - (offload.get("kept_resident_bytes") or 0)) / (h2d * 1e9)
        if h2d == h2d
        else None,
        "h2d_per_step_floor_s": (offload.get("last_step_h2d_bytes") or 0) / (h2d * 1e9) if h2d == h2d else None,
        "resident": resident,
        **_messages([e["data"].get("message", "") for e in events if e["type"] == "log"]),
    }
    return record


def headline_markdown(r: dict[str, Any]) -> str:
    job, load = r["job"], r.get("load") or {}
    step, floor = job.get("median_step_s"), r.get("copy_floor_s")
    offload = job.get("offload") or {}
    ratio = f"{step / floor:.2f} x" if step and floor else "—"
    streamed_floor = r.get("streamed_floor_s")
    streamed = f"{step / streamed_floor:.2f} x" if step and streamed_floor else "—"
    rows = [
        "| figure | value | against |",
        "|---|---|---|",
        f"| status | {job['status']} ({job['steps']} steps) | `succeeded` |",
        f"| median step (s) | {_f(step, '.3f')} | copy floor 2 x {r['weight_bytes'] / 1e9:.1f} GB / {r['h2d_gbps']:.1f} "
        f"GB/s = {_f(floor, '.3f')} s: **{ratio}** (target <= 1.10 x) |",
        f"| kept on the device (GiB) | {(offload.get('kept_resident_bytes') or 0) / GIB:.2f} | copy floor of the rest "
        f"{_f(r.get('streamed_floor_s'), '.3f')} s: {streamed} |",
        f"| peak GPU allocated (GiB) | {job['device_peak_gib']:.2f} | limit 24 GiB |",
        f"| pinned host (GiB) | {job['pinned_gib']:.2f} | weights {r['weight_bytes'] / GIB:.2f} GiB |",
        f"| POST -> first step (s) | {_f(job.get('post_to_first_step_s'), '.1f')} | load {_f(load.get('seconds'), '.1f')} s "
        f"at {_f(load.get('gb_per_s'), '.2f')} GB/s ({load.get('source')}) |",
        f"| peak host RSS at start (GiB) | {_f((load.get('peak_host_rss_bytes') or 0) / GIB, '.2f')} | pinned "
        f"{job['pinned_gib']:.2f} GiB |",
        f"| H2D per step (GB), copy wait | {_f((offload.get('last_step_h2d_bytes') or 0) / 1e9, '.1f')}, "
        f"{_f((offload.get('copy_wait_seconds') or 0), '.1f')} s total | ring "
        f"{(offload.get('planned_device_bytes') or 0) / GIB:.2f} GiB, overflows {offload.get('ring_overflows')} |",
    ]
    resident = r.get("resident")
    if resident:
        kept = resident.get("median_step_s")
        rows.append(
            f"| resident step (s): every unit kept, no limit | {resident['status']}, {_f(kept, '.3f')} | Ferry "
            f"{_f(step / kept if step and kept else None, '.2f')} x; peak {resident['device_peak_gib']:.2f} GiB |"
        )
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------- table 3
def write_sharded_checkpoint(directory: Path, shape: dict[str, Any], shard_bytes: int) -> dict[str, Any]:
    """A Qwen2-shaped checkpoint of random bf16 tensors (drawn on the GPU when there is one) in shards of
    about ``shard_bytes`` with a model.safetensors.index.json, flushed to disk and dropped from the page
    cache so that loading it reads the disk."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    write_config(directory, shape)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started, shards, current, size, weight_map = time.perf_counter(), [], {}, 0, {}

    def flush() -> None:
        nonlocal current, size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(current, str(directory / name), metadata={"format": "pt"})
        shards.append(name)
        weight_map.update(dict.fromkeys(current, name))
        current, size = {}, 0

    generator = torch.Generator(device).manual_seed(0)
    for key, param in model.state_dict().items():
        values = torch.randn(param.shape, generator=generator, device=device, dtype=torch.bfloat16).mul_(0.02)
        current[key] = values.cpu()
        size += values.numel() * 2
        if size >= shard_bytes:
            flush()
    if current:
        flush()
    total = sum((directory / s).stat().st_size for s in shards)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    for shard in shards:
        _drop_from_page_cache(directory / shard)
    return {"shards": len(shards), "bytes": total, "write_s": time.perf_counter() - started}


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_gbps(path: Path) -> dict[str, Any]:
    """The disk's own sequential read rate: ``dd iflag=direct`` (bypasses the page cache) over one shard."""
    command = ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    nbytes = path.stat().st_size
    _drop_from_page_cache(path)
    return {"command": " ".join(command), "bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
            "dd": done.stderr.strip().splitlines()[-1:] if done.stderr else []}  # fmt: skip


def run_in_process(spec: dict[str, Any], root: Path, output: str = "out") -> dict[str, Any]:
    """A job through jobs.run_job in this process; step times from the events' arrival."""
    import yaml

    from jobs import PathRoots, load_job_spec, run_job
    from jobs.events import LogEvent, StartedEvent, StepEvent

    roots = PathRoots(model_roots=[root / "models"], data_roots=[root / "datasets"])
    events, arrivals = [], []

    def report(event: Any) -> None:
        events.append(event)
        arrivals.append(time.perf_counter())

    started = time.perf_counter()
    outcome = run_job(load_job_spec(yaml.safe_dump(spec), roots=roots), output_dir=root / output, report=report)
    steps = [(e, t) for e, t in zip(events, arrivals, strict=True) if isinstance(e, StepEvent)]
    profiled = {3, 4} if TRAINING_EXTRA.get("profile") else set()  # training.profile's steps run under the profiler
    times = [b[1] - a[1] for a, b in itertools.pairwise(steps) if b[0].step not in profiled][1:]  # the first step
    # records the order
    start = next(e for e in events if isinstance(e, StartedEvent))
    last = steps[-1][0]
    return {
        "status": outcome.status,
        "steps": len(steps),
        "start_to_first_step_s": steps[0][1] - started if steps else None,
        "median_step_s": statistics.median(times) if times else None,
        "load": start.load.model_dump() if start.load else None,
        "device_peak_gib": last.device_peak_bytes / GIB,
        "device_reserved_gib": last.device_peak_reserved_bytes / GIB,  # the allocator's peak, not its last figure
        "pinned_gib": last.pinned_bytes / GIB,
        "offload": last.offload.as_dict() if last.offload else None,
        "losses": [e.loss for e, _ in steps],
        **_messages([e.message for e in events if isinstance(e, LogEvent)]),
        "step_times": times,
    }


def disk14b(args: argparse.Namespace) -> dict[str, Any]:
    root = args.out / "disk14b"
    shape = scaled(QWEN_14B, args.scale)
    checkpoint = write_sharded_checkpoint(root / "models" / "qwen2.5-14b-shape", shape, shard_bytes=4 * 10**9)
    disk = disk_read_gbps(root / "models" / "qwen2.5-14b-shape" / "model-00001.safetensors")
    corpus(root / "datasets" / "corpus")
    tokens = 4096 if args.scale >= 1 else 64
    spec = lora_spec("qwen14b-shape-lora-from-disk", "qwen2.5-14b-shape", args.limit or "16GiB", args.steps, tokens,
                     "checkpoint", "cpu" if args.cpu else "cuda", args.mixed_precision)  # fmt: skip
    job = run_in_process(spec, root)
    lora_params = _lora_params(shape, 16)
    return {"checkpoint": checkpoint, "disk": disk, "job": job, "h2d_gbps": pinned_h2d_gbps(),
            "weight_bytes": weight_bytes(shape), "lora_bytes": lora_params * 4}  # fmt: skip


def _lora_params(shape: dict[str, Any], rank: int) -> int:
    h, i, kv = shape["hidden_size"], shape["intermediate_size"], shape["hidden_size"] // shape["num_attention_heads"]
    kv *= shape["num_key_value_heads"]
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h)
    return rank * per_layer * shape["num_hidden_layers"]


def disk_markdown(r: dict[str, Any]) -> str:
    job, load, disk = r["job"], r["job"].get("load") or {}, r["disk"]
    rss = (load.get("peak_host_rss_bytes") or 0) / GIB
    budget = job["pinned_gib"] + r["lora_bytes"] / GIB
    rows = [
        "| figure | value | against |",
        "|---|---|---|",
        f"| checkpoint | {r['checkpoint']['shards']} shards, {r['checkpoint']['bytes'] / 1e9:.1f} GB "
        f"(written in {r['checkpoint']['write_s']:.0f} s) | |",
        f"| load into pinned memory (GB/s) | {_f(load.get('gb_per_s'), '.2f')} ({_f(load.get('seconds'), '.1f')} s) "
        f"| disk read (`{disk['command']}`) {disk['gb_per_s']:.2f} GB/s |",
        f"| peak host RSS (GiB) | {rss:.2f} | 1.15 x (pinned {job['pinned_gib']:.2f} + trainable/optimizer on the "
        f"host 0; adapters {r['lora_bytes'] / GIB:.2f} GiB on the GPU) = {1.15 * budget:.2f} |",
        f"| status, median step (s) | {job['status']}, {_f(job.get('median_step_s'), '.3f')} | copy floor "
        f"{2 * r['weight_bytes'] / (r['h2d_gbps'] * 1e9):.3f} s |",
        f"| peak GPU allocated / reserved (GiB) | {job['device_peak_gib']:.2f} / {job['device_reserved_gib']:.2f} "
        "| limit 16 GiB |",
    ]
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------- the disk tier
def disk32b(args: argparse.Namespace) -> dict[str, Any]:
    """A 32B-shape bf16 LoRA whose host memory is limited (``offload.host_memory_limit``, 16 GiB): the frozen weights
    beyond it are read from the checkpoint's shards on each use. Beside it: the disk's own read rate (``dd
    iflag=direct``), and the same job with every weight in pinned RAM (its step is the compute-and-link step the
    disk tier adds to). The goal: the limited step <= 1.15 x max(all-RAM step, disk floor), where the disk floor
    is what the tier read in a step over the dd rate. Needs about 70 GB of free disk and 80 GiB of RAM (for the
    all-RAM run) at full scale."""
    root = args.out / "disk32b"
    shape = scaled(QWEN_32B, args.scale)
    if args.scale < 1:  # enough layers that some stay in RAM beside the staging ring's three
        shape["num_hidden_layers"] = 8
    if args.layers:  # fewer of the same layers: a disk that cannot hold all 64 (~66 GB of shards) still measures
        shape["num_hidden_layers"] = args.layers  # the per-layer rates; give --host-limit the same share of weights
    checkpoint = write_sharded_checkpoint(root / "models" / "qwen2.5-32b-shape", shape, shard_bytes=4 * 10**9)
    disk = disk_read_gbps(root / "models" / "qwen2.5-32b-shape" / "model-00001.safetensors")
    corpus(root / "datasets" / "corpus")
    tokens = 4096 if args.scale >= 1 else 64
    weights = weight_bytes(shape)
    limit = args.host_limit or ("16GiB" if args.scale >= 1 else str(weights // 2))
    device = "cpu" if args.cpu else "cuda"

    def spec(name: str, host_limit: str | None) -> dict[str, Any]:
        job = lora_spec(name, "qwen2.5-32b-shape", args.limit or "24GiB", args.steps, tokens, "checkpoint", device,
                        args.mixed_precision)  # fmt: skip
        job["offload"]["host_memory_limit"] = host_limit
        job["checkpoint"] = {"save_final": False}
        return job

    limited = run_in_process(spec("qwen32b-shape-lora-host-16gib", limit), root, "limited")
    in_ram = run_in_process(spec("qwen32b-shape-lora-all-ram", None), root, "in-ram") if not args.no_ram else None
    return {"checkpoint": checkpoint, "disk": disk, "host_limit": limit, "weight_bytes": weights,
            "h2d_gbps": pinned_h2d_gbps(), "limited": limited, "in_ram": in_ram}  # fmt: skip


def _steady(job: dict[str, Any]) -> float | None:
    """The median step once the disk tier reads ahead (from the third step: the first records the order, the
    second the reads)."""
    times = job.get("step_times") or []
    steady = times[1:] if len(times) > 2 else times
    return statistics.median(steady) if steady else None


def disk32b_markdown(r: dict[str, Any]) -> str:
    limited, in_ram, disk = r["limited"], r["in_ram"], r["disk"]
    stats = limited.get("offload") or {}
    steps = max(limited["steps"], 1)
    read_per_step = stats.get("disk_read_bytes", 0) / steps
    disk_floor = read_per_step / (disk["gb_per_s"] * 1e9)
    copy_floor = 2 * r["weight_bytes"] / (r["h2d_gbps"] * 1e9)
    step, ram_step = _steady(limited), _steady(in_ram) if in_ram else None
    goal = 1.15 * max(ram_step or 0.0, disk_floor)
    rows = [
        "| figure | value | against |",
        "|---|---|---|",
        f"| checkpoint | {r['checkpoint']['shards']} shards, {r['checkpoint']['bytes'] / 1e9:.1f} GB | "
        f"`{disk['command']}`: {disk['gb_per_s']:.2f} GB/s |",
        f"| offload.host_memory_limit | {r['host_limit']} | weights {r['weight_bytes'] / GIB:.1f} GiB |",
        f"| frozen weights on disk / staging ring (GiB) | {stats.get('disk_weight_bytes', 0) / GIB:.1f} / "
        f"{stats.get('staging_bytes', 0) / GIB:.2f} | pinned in all {limited['pinned_gib']:.2f} GiB "
        f"(all in RAM: {in_ram['pinned_gib'] if in_ram else float('nan'):.2f}) |",
        f"| peak host RSS at load (GiB) | {((limited.get('load') or {}).get('peak_host_rss_bytes') or 0) / GIB:.2f} | |",
        f"| read from disk a step (GB) | {read_per_step / 1e9:.1f} | disk floor {disk_floor:.2f} s at the dd rate; "
        f"read {stats.get('disk_read_bytes', 0) / max(stats.get('disk_read_seconds') or 1e-9, 1e-9) / 1e9:.2f} GB/s "
        f"while reading; waited {stats.get('disk_wait_seconds', 0):.1f} s in all |",
        f"| median step from step 3 (s), limited | {_f(step, '.3f')} | goal <= 1.15 x max(all-RAM step, disk floor) "
        f"= {goal:.3f} s |",
        f"| median step from step 3 (s), all in RAM | {_f(ram_step, '.3f')} | copy floor {copy_floor:.3f} s |",
        f"| status / losses equal | {limited['status']} / "
        f"{'yes' if in_ram and in_ram['losses'] == limited['losses'] else 'no' if in_ram else '—'} | |",
    ]
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------- table 4
def full3b(args: argparse.Namespace) -> dict[str, Any]:
    """Full fine-tune of a Qwen2.5-3B-shaped model with model + optimizer offload under 16GiB, beside its
    floor: the larger of the copies and one CPU AdamW step over the same parameters."""
    root = args.out / "full3b"
    shape = scaled(QWEN_3B, args.scale)
    write_config(root / "models" / "qwen2.5-3b-shape", shape)
    corpus(root / "datasets" / "corpus")
    tokens = 4096 if args.scale >= 1 else 64
    spec = {
        "name": "qwen3b-shape-full-finetune",
        "device": "cpu" if args.cpu else "cuda",
        "model": {"kind": "hf_causal_lm", "path": "qwen2.5-3b-shape", "dtype": "bfloat16", "init": "random"},
        "data": {"kind": "text", "path": "corpus", "seq_len": tokens},
        "training": {
            "steps": args.steps,
            "batch_size": 1,
            "learning_rate": 1e-5,
            "gradient_checkpointing": True,
            **TRAINING_EXTRA,
        },
        "offload": {
            "enable_model_cpu_offload": True,
            "enable_optimizer_cpu_offload": True,
            "granularity": "block",
            "gpu_memory_limit": args.limit or "16GiB",
            "gpu_memory_budget": None,  # every unit streamed
        },
        "checkpoint": {"save_final": False},
    }
    job = run_in_process(spec, root)
    weights = weight_bytes(shape)
    h2d = pinned_h2d_gbps()
    return {"job": job, "weight_bytes": weights, "h2d_gbps": h2d, "optimizer_step_s": cpu_adamw_step_s(weights // 2)}


def cpu_adamw_step_s(numel: int) -> float:
    """One fused CPU AdamW step over ``numel`` bf16 parameters with gradients (state made by a first step)."""
    from jobs.spec.job import TrainingSpec
    from jobs.train.optim import build_optimizer

    param = torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16))
    param.grad = torch.full_like(param, 1e-3)
    optimizer = build_optimizer([param], TrainingSpec(steps=1, learning_rate=1e-5))
    optimizer.step()
    started = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - started


def full_markdown(r: dict[str, Any]) -> str:
    job = r["job"]
    copies = 2 * r["weight_bytes"] / (r["h2d_gbps"] * 1e9)
    floor = max(copies, r["optimizer_step_s"])
    step = job.get("median_step_s")
    rows = [
        "| figure | value | against |",
        "|---|---|---|",
        f"| status, median step (s) | {job['status']}, {_f(step, '.3f')} | floor max(copies {copies:.3f} s, CPU "
        f"AdamW step {r['optimizer_step_s']:.3f} s) = {floor:.3f} s: "
        f"**{_f(step / floor if step else None, '.2f')} x** |",
        f"| peak GPU allocated / reserved (GiB) | {job['device_peak_gib']:.2f} / {job['device_reserved_gib']:.2f} "
        "| limit 16 GiB |",
        f"| pinned host (GiB) | {job['pinned_gib']:.2f} | weights + gradients {2 * r['weight_bytes'] / GIB:.2f} GiB |",
        f"| losses | {', '.join(f'{x:.3f}' for x in job['losses'])} | |",
    ]
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------- table 5
def qlora70b(args: argparse.Namespace) -> dict[str, Any]:
    """A 70B QLoRA job over HTTP under 24GiB: NF4 quantized as it loads (random init drawn and quantized on the
    GPU, one weight at a time), beside the same job with every unit kept on the device (no limit)."""
    import httpx
    import yaml
    from gpu_e2e import run_job as follow_job
    from gpu_e2e import start_server

    root = args.out / "qlora70b"
    shape = scaled(LLAMA_70B, args.scale)
    write_config(root / "models" / "llama-3.1-70b-shape", shape)
    corpus(root / "datasets" / "corpus")
    tokens = 4096 if args.scale >= 1 else 64
    limited = lora_spec("llama70b-shape-qlora", "llama-3.1-70b-shape", args.limit or "24GiB", args.steps, tokens,
                        "random", "cpu" if args.cpu else "cuda", args.mixed_precision)  # fmt: skip
    limited["model"]["quantize"] = "nf4"
    limited["checkpoint"] = {"save_final": False}
    # Resident: every unit kept on the device by the budget, NF4 kept quantized (torchao dequantizes in each
    # layer, as an NF4 model on the GPU does), no limit. Not `offload: off`: its in-memory build would hold the
    # whole bf16 model (141 GB) in host memory before quantizing. 40 GiB holds the 36.9 GiB of NF4 weights and
    # bf16 embeddings; the fit check sizes a budget in dense bytes, so a larger one would be refused at submit.
    resident = copy.deepcopy(limited)
    resident["name"] = "llama70b-shape-qlora-resident"
    resident["offload"] = kept_on_device("40GiB", dequantize_on_arrival=False)
    server, url = start_server(root, "bench-token", {})
    runs = {}
    try:
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer bench-token"}, timeout=60) as client:
            for key, spec in (("limited", limited), ("resident", resident)):
                text = yaml.safe_dump(spec, sort_keys=False)
                validation = client.post(
                    "/v1/jobs/validate", content=text, headers={"Content-Type": "application/yaml"}
                )
                job = follow_job(client, spec["name"], text, timeout=args.timeout)
                events = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
                runs[key] = {"job": job, "spec": text, **_from_events(events),
                             "estimate": validation.json().get("estimate") if validation.status_code == 200 else None}  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)
    return {"runs": runs, "weight_bytes": weight_bytes(shape), "h2d_gbps": pinned_h2d_gbps()}


def _from_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The load (rates, quantized bytes, peak host RSS) and the last step's allocator peaks, from a job's events."""
    started: dict[str, Any] = next((e["data"] for e in events if e["type"] == "started"), {})
    last: dict[str, Any] = next((e["data"] for e in reversed(events) if e["type"] == "step"), {})
    logged = [e["data"].get("message", "") for e in events if e["type"] == "log"]
    return {"load": started.get("load") or {}, "device_peak_gib": (last.get("device_peak_bytes") or 0) / GIB,
            "device_reserved_gib": (last.get("device_peak_reserved_bytes") or 0) / GIB,
            **_messages(logged)}  # fmt: skip


def _messages(logged: list[str]) -> dict[str, str | None]:
    """The job's ``training.profile`` report and ``training.compile`` summary, from its log messages."""
    return {"profile": next((m for m in logged if m.startswith("profile of step")), None),
            "compile": next((m for m in logged if m.startswith("training.compile")), None)}  # fmt: skip


def profile_lines(record: Any, where: str = "") -> list[str]:
    """Every job's profile report and compile summary found in a run's record, named by where it lies."""
    if isinstance(record, dict):
        found = [f"- {where or 'job'}: {record[k]}" for k in ("profile", "compile") if isinstance(record.get(k), str)]
        return found + [line for k, v in record.items() for line in profile_lines(v, f"{where}.{k}".strip("."))]
    return []


def qlora_markdown(r: dict[str, Any]) -> str:
    limited, resident = r["runs"]["limited"], r["runs"]["resident"]
    load = limited["load"]
    dense, stored, quantize_s = load.get("bytes") or 0, load.get("stored_bytes") or 0, load.get("quantize_seconds")
    rss = (load.get("peak_host_rss_bytes") or 0) / GIB
    rows = [
        "| figure | 24 GiB limit, streamed | resident (all units kept, no limit) |",
        "|---|---|---|",
        f"| status, median step (s) | {limited['job']['status']}, {_f(limited['job'].get('median_step_s'), '.3f')} "
        f"| {resident['job']['status']}, {_f(resident['job'].get('median_step_s'), '.3f')} |",
        f"| load: drawn (GB/s) | {dense / 1e9:.1f} GB in {_f(load.get('seconds'), '.1f')} s = "
        f"{_f(load.get('gb_per_s'), '.2f')} | {_f(resident['load'].get('gb_per_s'), '.2f')} |",
        f"| quantize (GB/s of bf16) | {_f(dense / quantize_s / 1e9 if quantize_s else None, '.2f')} "
        f"({_f(quantize_s, '.1f')} s) | {_f(_rate(resident['load']), '.2f')} |",
        f"| pinned host (GiB) | {limited['job']['pinned_gib']:.2f} (NF4 payload {stored / GIB:.2f}; bf16 would be "
        f"{r['weight_bytes'] / GIB:.2f}) | {resident['job']['pinned_gib']:.2f} |",
        f"| peak host RSS at start (GiB) | {rss:.2f} | "
        f"{(resident['load'].get('peak_host_rss_bytes') or 0) / GIB:.2f} |",
        f"| peak GPU allocated / reserved (GiB) | {limited['device_peak_gib']:.2f} / "
        f"{limited['device_reserved_gib']:.2f} (limit 24) | {resident['device_peak_gib']:.2f} / "
        f"{resident['device_reserved_gib']:.2f} |",
    ]
    return "\n".join(rows) + "\n"


def _rate(load: dict[str, Any]) -> float | None:
    seconds = load.get("quantize_seconds")
    return (load.get("bytes") or 0) / seconds / 1e9 if seconds else None


def resident70b(args: argparse.Namespace) -> dict[str, Any]:
    """The 70B LoRA's bf16 resident step (no quantization, no limit), the other baseline of qlora70b's row.

    80 bf16 layers are 131 GiB of weights, which with the step's activations do not fit the H200's 140 GiB. The
    layers are identical, so the step grows by the same time per layer: the same job with 20 and with 40 layers
    (every unit kept on the device, in this process) gives the 80-layer step as t40 + 2 x (t40 - t20), the
    embedding and head counted once (the fit check extrapolates deep models the same way)."""
    root = args.out / "resident70b"
    corpus(root / "datasets" / "corpus")
    tokens = 4096 if args.scale >= 1 else 64
    layers = (20, 40) if args.scale >= 1 else (1, 2)
    runs = {}
    for n in layers:
        shape = {**scaled(LLAMA_70B, args.scale), "num_hidden_layers": n}
        name = f"llama-70b-shape-{n}-layers"
        write_config(root / "models" / name, shape)
        job = lora_spec(name, name, "24GiB", args.steps, tokens, "random", "cpu" if args.cpu else "cuda",
                        args.mixed_precision)  # fmt: skip
        job["offload"] = kept_on_device("200GiB")
        job["checkpoint"] = {"save_final": False}
        runs[n] = run_in_process(job, root, output=f"out-{n}")
        (args.out / f"resident70b-{n}.json").write_text(json.dumps(runs[n], indent=1, default=str))
        print(f"{n} layers: {runs[n]['status']}, median step {runs[n]['median_step_s']}", flush=True)
    short, long = (runs[n].get("median_step_s") for n in layers)
    full = LLAMA_70B["num_hidden_layers"] if args.scale >= 1 else 4
    per_layer = (long - short) / (layers[1] - layers[0]) if short and long else None
    projected = long + per_layer * (full - layers[1]) if per_layer is not None and long else None
    return {"runs": runs, "layers": list(layers), "per_layer_s": per_layer, "projected_step_s": projected,
            "full_layers": full}  # fmt: skip


def resident70b_markdown(r: dict[str, Any]) -> str:
    rows = ["| layers | status | median step (s) | peak GPU allocated / reserved (GiB) |", "|---|---|---|---|"]
    for n in r["layers"]:
        job = r["runs"][n]
        rows.append(f"| {n} | {job['status']} | {_f(job.get('median_step_s'), '.3f')} | "
                    f"{job['device_peak_gib']:.2f} / {job['device_reserved_gib']:.2f} |")  # fmt: skip
    rows.append(f"| {r['full_layers']} (extrapolated: {_f(r['per_layer_s'], '.4f')} s a layer) | | "
                f"**{_f(r['projected_step_s'], '.3f')}** | |")  # fmt: skip
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------- table 6
def long32k(args: argparse.Namespace) -> dict[str, Any]:
    """The 32B shape's bf16 LoRA at 32768 tokens under 24GiB with activation offload, beside the resident step
    at the same length (every unit kept on the device, no limit) and the 24GiB step at 4096 tokens; in this
    process. Each job's record is written to --out as it ends, so a run cut short keeps the jobs it finished."""
    root = args.out / "long32k"
    shape = scaled(QWEN_32B, args.scale)
    write_config(root / "models" / "qwen2.5-32b-shape", shape)
    corpus(root / "datasets" / "corpus")
    long, short = (32768, 4096) if args.scale >= 1 else (256, 64)
    device, limit = "cpu" if args.cpu else "cuda", args.limit or "24GiB"

    def spec(name: str, tokens: int, offload: dict[str, Any]) -> dict[str, Any]:
        job = lora_spec(name, "qwen2.5-32b-shape", limit, args.steps, tokens, "random", device, args.mixed_precision)
        return {**job, "offload": offload, "checkpoint": {"save_final": False}}

    streamed = {
        "enable_model_cpu_offload": True,
        "granularity": "block",
        "gpu_memory_limit": limit,
        "gpu_memory_budget": None,
    }
    kept = kept_on_device("64GiB")  # resident: every unit kept on the device, no limit
    jobs = {
        "offloaded_long": spec("qwen32b-shape-lora-32k-offload", long, {**streamed, "activations": True}),
        "streamed_short": spec("qwen32b-shape-lora-4k", short, streamed),
        "resident_long": spec("qwen32b-shape-lora-32k-resident", long, kept),
    }
    estimates = {key: estimated_peak(job, root) for key, job in jobs.items()}  # the fit check's, before running
    runs = {}
    for key, job in jobs.items():
        runs[key] = {**run_in_process(job, root, output=f"out-{key}"), "estimated_peak_gib": estimates[key]}
        (args.out / f"long32k-{key}.json").write_text(json.dumps(runs[key], indent=1, default=str))
        print(f"{key}: {runs[key]['status']}, median step {runs[key]['median_step_s']}", flush=True)
    return {"runs": runs, "tokens": {"long": long, "short": short}, "weight_bytes": weight_bytes(shape)}


def estimated_peak(spec: dict[str, Any], root: Path) -> float:
    """The fit check's peak device estimate (GiB) for ``spec``: what a submit over HTTP is checked against."""
    import yaml

    from jobs import PathRoots, estimate_memory, load_job_spec

    roots = PathRoots(model_roots=[root / "models"], data_roots=[root / "datasets"])
    return estimate_memory(load_job_spec(yaml.safe_dump(spec), roots=roots)).peak_device_bytes / GIB


def long_markdown(r: dict[str, Any]) -> str:
    tokens = r["tokens"]
    columns = [("offloaded_long", f"{tokens['long']} tokens, 24 GiB, activations offloaded"),
               ("resident_long", f"{tokens['long']} tokens, every unit kept on the device, no limit"),
               ("streamed_short", f"{tokens['short']} tokens, 24 GiB")]  # fmt: skip
    runs = [r["runs"][key] for key, _ in columns]

    def row(label: str, cell: Any) -> str:
        return f"| {label} | " + " | ".join(cell(job) for job in runs) + " |"

    def per_token(job: dict[str, Any], n: int) -> str:
        step = job.get("median_step_s")
        return _f(n / step if step else None, ".0f")

    counts = [tokens["long"], tokens["long"], tokens["short"]]
    rows = [
        "| figure | " + " | ".join(label for _, label in columns) + " |",
        "|---|---|---|---|",
        row("status, median step (s)", lambda j: f"{j['status']}, {_f(j.get('median_step_s'), '.3f')}"),
        "| tokens/s | " + " | ".join(per_token(j, n) for j, n in zip(runs, counts, strict=True)) + " |",
        row(
            "peak GPU allocated / reserved (GiB)",
            lambda j: f"{j['device_peak_gib']:.2f} / {j['device_reserved_gib']:.2f}",
        ),
        row("fit check's estimated peak (GiB)", lambda j: f"{j['estimated_peak_gib']:.2f}"),
        row("pinned host (GiB)", lambda j: f"{j['pinned_gib']:.2f}"),
        row(
            "checkpointed inputs on the host (GiB)",
            lambda j: f"{((j.get('offload') or {}).get('activation_host_bytes') or 0) / GIB:.2f}",
        ),
        row("H2D per step (GB)", lambda j: f"{((j.get('offload') or {}).get('last_step_h2d_bytes') or 0) / 1e9:.1f}"),
    ]
    return "\n".join(rows) + "\n"


def _f(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


RUNS = {
    "headline": (headline, headline_markdown),
    "disk14b": (disk14b, disk_markdown),
    "full3b": (full3b, full_markdown),
    "qlora70b": (qlora70b, qlora_markdown),
    "resident70b": (resident70b, resident70b_markdown),
    "long32k": (long32k, long_markdown),
    "disk32b": (disk32b, disk32b_markdown),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", choices=RUNS)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--limit",
        help="gpu_memory_limit (default: 24GiB for headline, qlora70b and long32k, 16GiB for disk14b and full3b)",
    )
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--budget", help="headline: offload.gpu_memory_budget (units kept on the device)")
    parser.add_argument("--prefetch", type=int, help="headline: offload.prefetch (ring slots = prefetch + 1)")
    parser.add_argument("--resident", action="store_true", help="headline: the same job resident beside it")
    parser.add_argument("--whole-layers", type=int, help="headline: model.uncheckpointed_layers (not recomputed)")
    parser.add_argument(
        "--mixed-precision",
        choices=["no", "bf16"],
        default="no",
        help="training.mixed_precision of the LoRA jobs (the shipped LLM configs run bf16)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="training.profile: each job's shares of a step and MFU (steps 3-4 profiled: use --steps 8 or more, so "
        "that the median step of a job followed over HTTP is an unprofiled one)",
    )
    parser.add_argument("--kernels", choices=["liger", "none"], help="training.kernels of every job")
    parser.add_argument("--compile", action="store_true", help="training.compile: true for every job")
    parser.add_argument(
        "--host-limit", help="disk32b: offload.host_memory_limit (default 16GiB; a third of the weights scaled)"
    )
    parser.add_argument("--layers", type=int, help="disk32b: this many of the shape's layers (a smaller disk)")
    parser.add_argument("--no-ram", action="store_true", help="disk32b: skip the all-RAM run (a box without 80 GiB)")
    parser.add_argument("--cpu", action="store_true", help="CPU jobs (with --scale < 1): checks the path anywhere")
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    TRAINING_EXTRA.update({"profile": True} if args.profile else {})
    TRAINING_EXTRA.update({"kernels": args.kernels} if args.kernels else {})
    TRAINING_EXTRA.update({"compile": True} if args.compile else {})
    if args.compile and args.cpu:  # the in-process jobs' graphs, without inductor's minutes of code generation here
        from jobs.models import compiled_blocks

        compiled_blocks.BACKEND = "aot_eager"
    run, markdown = RUNS[args.run]
    record = run(args)
    from provenance import commit

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    header = (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC — {device} — torch {torch.__version__} — "
        f"commit {commit()}\n\nReproduce: `python bench/big_models.py {args.run} --out {args.out.name}"
        f"{' --cpu' if args.cpu else ''}{f' --scale {args.scale:g}' if args.scale != 1.0 else ''}"
        f"{f' --steps {args.steps}' if args.steps != 5 else ''}{f' --limit {args.limit}' if args.limit else ''}"
        f"{f' --budget {args.budget}' if args.budget else ''}"
        f"{f' --prefetch {args.prefetch}' if args.prefetch is not None else ''}{' --resident' if args.resident else ''}"
        f"{f' --whole-layers {args.whole_layers}' if args.whole_layers else ''}"
        f"{f' --mixed-precision {args.mixed_precision}' if args.mixed_precision != 'no' else ''}"
        f"{' --profile' if args.profile else ''}{f' --kernels {args.kernels}' if args.kernels else ''}"
        f"{' --compile' if args.compile else ''}"
        f"{f' --host-limit {args.host_limit}' if args.host_limit else ''}{' --no-ram' if args.no_ram else ''}"
        f"{f' --layers {args.layers}' if args.layers else ''}`\n\n"
    )
    found = profile_lines(record)
    text = header + markdown(record) + ("\n" + "\n".join(found) + "\n" if found else "")
    print(text, flush=True)
    (args.out / f"{args.run}.json").write_text(json.dumps(record, indent=1, default=str))
    (args.out / f"{args.run}.md").write_text(text)


if __name__ == "__main__":
    main()
