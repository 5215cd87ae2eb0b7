"""GRPO with LoRA on models bigger than the card: generation tokens/s and step time under a memory limit,
beside the same job resident and (where trl is installed) TRL's ``GRPOTrainer`` on the resident model.

Rows, each a job in a process of its own (a big job's pinned host copy must be back with the system before the
next one starts):

- ``resident``: Llama-3-8B's shape, random bf16 weights, LoRA r16 on every linear, no memory limit, every unit
  kept on the device (``gpu_memory_budget`` above the weights: the engine copies nothing after step 1).
- ``limit``: the same job under ``offload.gpu_memory_limit`` (default 24GiB), the default budget (``auto``). Its
  decode loop holds the units training streams on the device for the whole loop where they fit beside the KV
  cache ("units held for generation"); the rest stream once per decode step.
- ``trl``: TRL's ``GRPOTrainer`` on the same shape, resident, peft LoRA, the same G, new tokens and prompts
  (skipped when trl is not importable; its generation is timed around transformers' ``generate``).
- ``32b``: Qwen2.5-32B's shape under the same limit.

Every row samples ``--generations`` completions of ``--prompts`` prompts a step, ``--new-tokens`` each (a random
model seldom stops early), rewarded by a string_check grader. Step times are medians after the first step
(which records the offload order); the generation and training figures are the grpo step events' own.

    python bench/grpo_bench.py --out grpo                          # every row, full shapes, on the GPU
    python bench/grpo_bench.py --out grpo --rows resident,limit    # some rows
    python bench/grpo_bench.py --out grpo --rows resident,limit --compile   # training.compile: compiled decode
    python bench/grpo_bench.py --out grpo-cpu --scale tiny         # the same paths, tiny, on the CPU

Prints a markdown table and writes it with the JSON record to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import logging
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from big_models import ALL_LINEAR, GIB, QWEN_32B, config_of, scaled, write_config  # noqa: E402
from provenance import commit  # noqa: E402

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "tie_word_embeddings": False}  # fmt: skip
ROWS = ("resident", "limit", "trl", "32b")
SHAPES = {"resident": ("llama-8b-shape", LLAMA_8B), "limit": ("llama-8b-shape", LLAMA_8B),
          "trl": ("llama-8b-shape", LLAMA_8B), "32b": ("qwen2.5-32b-shape", QWEN_32B)}  # fmt: skip
GRADER = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "like",
}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes: the full ones on the GPU, or tiny ones (a 2-layer model, 16 tokens) on the CPU."""
    tiny = args.scale == "tiny"
    return {
        "device": "cpu" if tiny else "cuda",
        "new_tokens": 16 if tiny else args.new_tokens,
        "precision": "no" if tiny else "bf16",
        "dtype": "float32" if tiny else "bfloat16",
    }


def write_data(root: Path, prompts: int) -> None:
    """A BPE tokenizer with a chat template and conversational prompt rows with an answer column."""
    from tests.jobs.llm_helpers import save_bpe_tokenizer, write_jsonl

    save_bpe_tokenizer(root / "models" / "tok")
    rows = [
        {"prompt": [{"role": "user", "content": f"the ferry streams {i} weights and {i + 1} more"}], "answer": str(i)}
        for i in range(max(64, prompts * 8))
    ]
    write_jsonl(root / "datasets" / "prompts.jsonl", rows)


def ferry_job(row: str, args: argparse.Namespace) -> dict[str, Any]:
    """The grpo job of a Ferry row: LoRA, block units, the limit (``limit``, ``32b``) or all kept resident."""
    run = settings(args)
    model_dir, _ = SHAPES[row]
    if row == "resident":
        offload = {"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_budget": "1000GiB"}
    else:
        offload = {"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_limit": args.limit}
    return {
        "name": f"grpo-{row}",
        "device": run["device"],
        "model": {"kind": "hf_causal_lm", "path": model_dir, "dtype": run["dtype"], "init": "random"},
        "data": {
            "kind": "text",
            "path": "prompts.jsonl",
            "format": "prompt",
            "seq_len": 64 + run["new_tokens"],
            "tokenizer": {"kind": "hf", "path": "tok"},
        },
        "lora": {"target_modules": ALL_LINEAR, "rank": 16},
        "training": {
            "objective": "grpo",
            "steps": args.steps,
            "batch_size": args.prompts,
            "learning_rate": 1e-5,
            "gradient_checkpointing": True,
            "mixed_precision": run["precision"],
            "compile": args.compile,
            "grpo": {"num_generations": args.generations, "max_new_tokens": run["new_tokens"], "grader": GRADER},
        },
        "offload": offload,
        "checkpoint": {"save_final": False},
    }


def run_ferry(row: str, args: argparse.Namespace) -> dict[str, Any]:
    """One Ferry row through jobs.run_job in this process; step times from the step events' arrival."""
    import yaml

    from jobs import PathRoots, load_job_spec, run_job
    from jobs.events import StepEvent

    root = args.out
    roots = PathRoots(model_roots=[root / "models"], data_roots=[root / "datasets"])
    steps: list[tuple[StepEvent, float]] = []

    def report(event: Any) -> None:
        if isinstance(event, StepEvent):
            steps.append((event, time.perf_counter()))

    spec = load_job_spec(yaml.safe_dump(ferry_job(row, args)), roots=roots)
    outcome = run_job(spec, output_dir=root / f"out-{row}", report=report, resume=False)
    # From step 3 on: step 1 records the offload order, and the measured ("auto") budget applies after step 2.
    durations = [b[1] - a[1] for a, b in itertools.pairwise(steps)][1:]
    figures = [e.grpo for e, _ in steps[2:] if e.grpo is not None]
    last = steps[-1][0]
    return {
        "status": outcome.status,
        "steps": len(steps),
        "step_s": median(durations),
        "generation_tokens_per_s": median([f.generation_tokens_per_s for f in figures]),
        "generation_s": median([f.generation_s for f in figures]),
        "training_s": median([f.training_s for f in figures]),
        "training_tokens_per_s": median([f.training_tokens_per_s for f in figures]),
        "completion_length": median([f.completion_length for f in figures]),
        "generation_units_kept": median([f.generation_units_kept for f in figures]),
        "device_peak_gib": last.device_peak_bytes / GIB,
        "device_reserved_gib": last.device_peak_reserved_bytes / GIB,
        "kept_resident_gib": (last.offload.kept_resident_bytes / GIB) if last.offload else None,
        "h2d_gb_per_step": (last.offload.last_step_h2d_bytes / 1e9) if last.offload else None,
        "losses": [e.loss for e, _ in steps],
    }


@contextlib.contextmanager
def timed_generate(record: list[tuple[float, int]]) -> Iterator[None]:
    """Time every call of transformers' ``generate`` (what TRL samples with when vLLM is off): seconds, tokens."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.generate

    def generate(self: Any, *a: Any, **k: Any) -> Any:
        inputs = k.get("input_ids", a[0] if a else None)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = original(self, *a, **k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        new = sequences.shape[1] - (inputs.shape[1] if inputs is not None else 0)
        record.append((time.perf_counter() - started, sequences.shape[0] * new))
        return out

    GenerationMixin.generate = generate  # type: ignore[method-assign]
    try:
        yield
    finally:
        GenerationMixin.generate = original  # type: ignore[method-assign]


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer on the resident 8B shape (random weights drawn on the device), peft LoRA r16."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    run, root = settings(args), args.out
    _, shape = SHAPES["trl"]
    device = torch.device(run["device"])
    dtype = torch.bfloat16 if run["dtype"] == "bfloat16" else torch.float32
    with device:
        model = AutoModelForCausalLM.from_config(config_of(scaled(shape, 0.01) if args.scale == "tiny" else shape),
                                                 dtype=dtype)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(root / "models" / "tok")
    rows = [json.loads(line) for line in (root / "datasets" / "prompts.jsonl").read_text().splitlines()]

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [float(a in t) for t, a in zip(texts, answer, strict=True)]

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            stamps.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(root / "out-trl"),
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=run["new_tokens"],
        max_steps=args.steps,
        learning_rate=1e-5,
        bf16=run["precision"] == "bf16",
        gradient_checkpointing=True,
        beta=0.0,
        loss_type="dapo",
        temperature=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=run["device"] == "cpu",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=ALL_LINEAR, task_type="CAUSAL_LM"),
        callbacks=[Stamp()],
    )
    generations: list[tuple[float, int]] = []
    with timed_generate(generations):
        trainer.train()
    later = generations[2:] or generations  # as the Ferry rows: from step 3 on
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    return {
        "status": "succeeded",
        "steps": len(stamps),
        "step_s": median([b - a for a, b in itertools.pairwise(stamps)][1:]),
        "generation_tokens_per_s": median([tokens / seconds for seconds, tokens in later]),
        "generation_s": median([seconds for seconds, _ in later]),
        "device_peak_gib": peak,
    }


def median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rows = [row for row in args.rows.split(",") if row]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    write_data(args.out, args.prompts)
    for row in rows:
        model_dir, shape = SHAPES[row]
        if not (args.out / "models" / model_dir).is_dir():
            write_config(args.out / "models" / model_dir, scaled(shape, 0.01) if args.scale == "tiny" else shape)
    runs: dict[str, Any] = {}
    for row in rows:
        if row == "trl" and not trl_installed():
            runs[row] = {"status": "skipped: trl is not installed"}
            continue
        result = args.out / f"{row}.json"
        # -X faulthandler: a row past --row-timeout gets SIGABRT, which prints every thread's stack (where it hung).
        command = [sys.executable, "-X", "faulthandler", __file__, "--only", row, *sys.argv[1:]]
        print(f"{row}: {' '.join(command[3:])}", flush=True)
        runs[row] = run_row(command, result, args.row_timeout)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": commit(),
        "limit": args.limit,
        "prompts": args.prompts,
        "generations": args.generations,
        "new_tokens": settings(args)["new_tokens"],
        "scale": args.scale,
        "compile": args.compile,
        "runs": runs,
    }


def run_row(command: list[str], result: Path, timeout: float | None) -> dict[str, Any]:
    """One row's process; past ``timeout`` seconds it is aborted (its stacks on stderr) and reported as timed out."""
    process = subprocess.Popen(command)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return {"status": f"timed out after {timeout:.0f} s"}
    return json.loads(result.read_text()) if code == 0 else {"status": f"failed ({code})"}


def trl_installed() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def markdown(r: dict[str, Any]) -> str:
    def f(value: Any, digits: str = ".3f") -> str:
        return format(value, digits) if isinstance(value, int | float) else "—"

    head = (
        f"{r['date']}, {r['gpu']}, torch {r['torch']}, commit {r['commit']}; {r['prompts']} prompts x "
        f"G = {r['generations']}, {r['new_tokens']} new tokens, LoRA r16 on every linear, scale {r['scale']}"
        f"{', training.compile' if r.get('compile') else ''}"
    )
    lines = [
        head,
        "",
        "| row | step | generation | generation tokens/s | training | training tokens/s | H2D per step | "
        "kept on the GPU | units held for generation | peak allocated / reserved |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"resident": "Ferry 8B resident", "limit": f"Ferry 8B, limit {r['limit']}", "trl": "TRL GRPOTrainer 8B resident",
             "32b": f"Ferry 32B, limit {r['limit']}"}  # fmt: skip
    for row, run in r["runs"].items():
        if "step_s" not in run:
            lines.append(f"| {names[row]} | {run['status']} | | | | | | | | |")
            continue
        lines.append(
            f"| {names[row]} | {f(run['step_s'])} s | {f(run.get('generation_s'))} s | "
            f"{f(run.get('generation_tokens_per_s'), '.1f')} | {f(run.get('training_s'))} s | "
            f"{f(run.get('training_tokens_per_s'), '.1f')} | {f(run.get('h2d_gb_per_step'), '.2f')} GB | "
            f"{f(run.get('kept_resident_gib'), '.1f')} GiB | {f(run.get('generation_units_kept'), '.0f')} | "
            f"{f(run.get('device_peak_gib'), '.1f')} / "
            f"{f(run.get('device_reserved_gib'), '.1f')} GiB |"
        )
    steps = {row: run.get("step_s") for row, run in r["runs"].items()}
    if steps.get("limit") and steps.get("resident"):
        lines += ["", f"limit / resident step: {steps['limit'] / steps['resident']:.2f}x (goal <= 1.5x)"]
    if steps.get("resident") and steps.get("trl"):
        lines += [f"Ferry resident / TRL step: {steps['resident'] / steps['trl']:.2f}x (goal <= 1.0x)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2, help="prompts a step; each gets --generations completions")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--limit", default="24GiB")
    parser.add_argument("--scale", choices=["full", "tiny"], default="full", help="tiny: 2-layer shapes on the CPU")
    parser.add_argument("--compile", action="store_true",
                        help="training.compile: the blocks and GRPO's decode step (a static KV cache, CUDA graphs)")  # fmt: skip
    parser.add_argument(
        "--row-timeout", type=float, help="seconds a row may run before it is aborted and its stacks printed"
    )
    parser.add_argument("--only", choices=ROWS, help="run one row in this process (used by the others)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the job's own lines
        run = run_trl(args) if args.only == "trl" else run_ferry(args.only, args)
        (args.out / f"{args.only}.json").write_text(json.dumps(run, default=str))
        return
    record = measure(args)
    text = markdown(record)
    print(text)
    (args.out / "grpo_bench.json").write_text(json.dumps(record, indent=2, default=str))
    (args.out / "grpo_bench.md").write_text(text)


if __name__ == "__main__":
    main()
