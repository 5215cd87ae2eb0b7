"""Issue 53's speed rows: LoRA on Llama-3.2-3B's shape, Ferry beside plain transformers + peft resident.

    python bench/speed_bench.py --out speed --steps 8            # every row, one run, one GPU
    python bench/speed_bench.py --out speed --rows lora4k --write   # also put the table into bench/RESULTS.md
    python bench/speed_bench.py --out speed --cpu --scale 0.01   # the same path, tiny, on the CPU
    python bench/speed_bench.py --out speed --steps 8 --profile  # each cell's profile: shares of the step, MFU

Each cell runs in its own child process (Liger-Kernel patches transformers' classes for the whole process, and
each cell's allocator peaks must be its own). The baseline is what a user of plain transformers + peft writes:
the bf16 model resident on the GPU, `get_peft_model` (rank 16 on every projection), gradient checkpointing,
fused AdamW over the adapters, the loss from `labels`. Ferry's cells are the same job as a Ferry spec, run through
`jobs.run_job` in the child: `hf_causal_lm` from the shape's config.json, `init: random`, the same LoRA, optimizer,
tokens and checkpointing, `offload: {enable_model_cpu_offload: true, granularity: block}` and nothing else (so
`gpu_memory_budget` is its default, `auto`). Median step after two warm-up steps; peak allocated and reserved
memory over the timed steps. With ``--profile`` each cell also reports ``training.profile``'s figures (the share of
the step in matmuls, attention, copies waited, optimizer and the rest; TFLOP/s and MFU): a Ferry cell from its job
(steps 3-4 profiled, left out of its median, two more steps run), a plain cell from two more steps under the same
profiler (bench/profiled.py). On the CPU (``--cpu``) compiled cells use dynamo's ``aot_eager`` backend: the same
graphs without inductor's code generation, which takes minutes on a small CPU.
"""

from __future__ import annotations

import argparse
import datetime
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
import big_models  # noqa: E402
from big_models import ALL_LINEAR, GIB, config_of, corpus, lora_spec, run_in_process, scaled, write_config  # noqa: E402
from doc_sections import replace_section  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "speed_bench"

LLAMA_3B = {"model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
            "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 128256,
            "tie_word_embeddings": True}  # fmt: skip

# row -> (tokens, gpu_memory_limit of Ferry's cells, cells). A cell is "plain", "plain-liger" or "ferry" plus
# "+liger" / "+compile" for the spec's training.kernels / training.compile.
ROWS: dict[str, tuple[int, str | None, list[str]]] = {
    "lora4k": (4096, None, ["plain", "plain-liger", "ferry", "ferry+liger", "ferry+liger+compile"]),
    "lora16k": (16384, "6GiB", ["plain", "ferry", "ferry+liger", "ferry+liger+compile"]),
}


def _peaks() -> tuple[float, float]:
    if not torch.cuda.is_available():
        return float("nan"), float("nan")
    return torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB


def plain_cell(shape: dict[str, Any], tokens: int, steps: int, liger: bool, profile: bool = False) -> dict[str, Any]:
    """transformers + peft, resident: the baseline every Ferry cell is divided by."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # RMSNorm, RoPE, SwiGLU and the fused linear + cross-entropy
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config_of(shape), dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=ALL_LINEAR, lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
    times = []
    for index in range(steps + 2):
        if index == 2 and device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= 2:
            times.append(time.perf_counter() - started)
    allocated, reserved = _peaks()
    result = {"status": "succeeded", "median_step_s": statistics.median(times), "allocated_gib": allocated,
              "reserved_gib": reserved}  # fmt: skip
    if profile:
        from profiled import profile_steps

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        result["profile"] = profile_steps(step, model, tokens, tokens, torch.device(device), torch.bfloat16)
    return result


def ferry_spec(cell: str, tokens: int, steps: int, limit: str | None, cpu: bool) -> dict[str, Any]:
    extra = 2 if big_models.TRAINING_EXTRA.get("profile") else 0  # steps 3-4 profiled, left out of the median
    spec = lora_spec(f"speed-{cell.replace('+', '-')}", "llama-3.2-3b-shape", limit or "", steps + 2 + extra, tokens,
                     "random", "cpu" if cpu else "cuda")  # fmt: skip
    spec["offload"] = {"enable_model_cpu_offload": True, "granularity": "block"}
    if limit:
        spec["offload"]["gpu_memory_limit"] = limit
    spec["training"]["optimizer"] = "adamw"
    if "+liger" in cell:
        spec["training"]["kernels"] = "liger"
    if "+compile" in cell:
        spec["training"]["compile"] = True
    spec["checkpoint"] = {"save_final": False}
    return spec


def ferry_cell(root: Path, cell: str, tokens: int, steps: int, limit: str | None, cpu: bool) -> dict[str, Any]:
    spec = ferry_spec(cell, tokens, steps, limit, cpu)
    try:
        run = run_in_process(spec, root, output=f"out-{cell}")
    except Exception as error:  # a spec this version refuses (no training.compile yet) is a row, not a crash
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        problems = " ".join(lines[1:3] or lines)  # a listed refusal's first problems, or a one-line error whole
        return {"status": f"refused: {problems[:200]}", "median_step_s": None}
    offload = run.get("offload") or {}
    return {"status": run["status"], "median_step_s": run["median_step_s"], "allocated_gib": run["device_peak_gib"],
            "reserved_gib": run["device_reserved_gib"], "kept_gib": (offload.get("kept_resident_bytes") or 0) / GIB,
            "h2d_gb_per_step": (offload.get("last_step_h2d_bytes") or 0) / 1e9, "profile": run.get("profile"),
            "compile": run.get("compile")}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    """One cell in this process; prints its JSON on the last line."""
    tokens, limit, _ = ROWS[args.row]
    if args.scale < 1:
        tokens = 64
    shape = scaled(LLAMA_3B, args.scale)
    if args.profile:
        big_models.TRAINING_EXTRA["profile"] = True  # lora_spec's jobs take it; run_in_process leaves steps 3-4 out
    if args.cpu:
        from jobs.models import compiled_blocks

        compiled_blocks.BACKEND = "aot_eager"
    if args.cell.startswith("plain"):
        if args.cell == "plain-liger" and not torch.cuda.is_available():
            result: dict[str, Any] = {"status": "skipped: Liger-Kernel needs CUDA", "median_step_s": None}
        else:
            result = plain_cell(shape, tokens, args.steps, liger=args.cell == "plain-liger", profile=args.profile)
    else:
        result = ferry_cell(args.out / "root", args.cell, tokens, args.steps, limit, args.cpu)
    print(json.dumps(result))


def prepare(out: Path, scale: float) -> None:
    root = out / "root"
    write_config(root / "models" / "llama-3.2-3b-shape", scaled(LLAMA_3B, scale))
    corpus(root / "datasets" / "corpus")


def commit() -> str:
    if os.environ.get("FERRY_COMMIT"):  # the device's copy of the tree has no .git
        return os.environ["FERRY_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return done.stdout.strip() or "unknown"


def _cell_text(result: dict[str, Any], baseline: float | None) -> str:
    step = result.get("median_step_s")
    if not step:
        return result["status"]
    text = f"{step * 1e3:.1f} ms"
    if baseline:
        text += f" (**{step / baseline:.2f} ×**)"
    if result.get("allocated_gib") == result.get("allocated_gib"):  # not NaN
        text += f", {result['allocated_gib']:.2f} / {result['reserved_gib']:.2f} GiB"
    if result.get("kept_gib"):
        text += f", kept {result['kept_gib']:.2f} GiB, H2D {result['h2d_gb_per_step']:.1f} GB/step"
    return text


def markdown(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        "## Faster than resident (issue 53)",
        "",
        f"{datetime.date.today()} — {gpu} — torch {torch.__version__} — commit {commit()}",
        "",
        f"Reproduce: `python bench/speed_bench.py --out speed --steps {args.steps} --rows {args.rows}"
        f"{' --profile' if args.profile else ''} --write`. "
        "LoRA rank 16 on every projection of Llama-3.2-3B's shape (bf16, random init), one row a step, "
        "checkpointing, AdamW; each cell: median step (× the plain transformers + peft resident step of its row), "
        "peak allocated / reserved GPU memory.",
        "",
        "| row | cell | step, × plain, allocated / reserved |",
        "|---|---|---|",
    ]
    for row, cells in results.items():
        tokens, limit, _ = ROWS[row]
        baseline = cells.get("plain", {}).get("median_step_s")
        label = f"{tokens} tokens" + (f", Ferry under gpu_memory_limit {limit}" if limit else "")
        for cell, result in cells.items():
            lines.append(f"| {label} | {cell} | {_cell_text(result, baseline if cell != 'plain' else None)} |")
    notes = [f"- {row}, {cell}: {result[key]}" for row, cells in results.items() for cell, result in cells.items()
             for key in ("compile", "profile") if result.get(key)]  # fmt: skip
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--cells", help="only these cells (comma-separated), e.g. plain,ferry")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--write", action="store_true", help="put the table into bench/RESULTS.md")
    parser.add_argument("--profile", action="store_true", help="each cell's training.profile figures (shares, MFU)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        child(args)
        return
    prepare(args.out, args.scale)
    wanted = set(args.cells.split(",")) if args.cells else None
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for row in args.rows.split(","):
        results[row] = {}
        for cell in ROWS[row][2]:
            if wanted and cell not in wanted:
                continue
            command = [sys.executable, __file__, "--out", str(args.out), "--row", row, "--cell", cell,
                       "--steps", str(args.steps), "--scale", str(args.scale)] + (["--cpu"] if args.cpu else []) \
                + (["--profile"] if args.profile else [])  # fmt: skip
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                last = done.stdout.strip().splitlines()[-1:] or ["{}"]
                result = json.loads(last[0]) if done.returncode == 0 else {"status": f"failed ({done.returncode})"}
                if done.returncode:
                    (args.out / f"{row}-{cell}.log").write_text(done.stdout + done.stderr)
            except subprocess.TimeoutExpired:
                result = {"status": f"timed out after {args.timeout:.0f} s"}
            results[row][cell] = result
            print(row, cell, json.dumps(result), flush=True)
    text = markdown(results, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speed.md").write_text(text)
    (args.out / "speed.json").write_text(json.dumps(results, indent=2))
    print(text)
    if args.write:
        replace_section(RESULTS, SECTION, text)


if __name__ == "__main__":
    main()
