"""DPO under offload beside SFT on the same tokens, in one run: a LoRA DPO step (one pair: chosen and rejected
rows of ``--seq`` tokens each) against an SFT step of two chat rows of the same length, both streaming the
same model under the same memory limit.

    python bench/preference_bench.py --out dpo32b                       # Qwen2.5-32B's shape, 24GiB limit
    python bench/preference_bench.py --out dpo32b --cpu --scale 0.02    # the same path, tiny, anywhere

Prints a markdown table and writes it with the JSON record to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from big_models import ALL_LINEAR, QWEN_32B, run_in_process, scaled, write_config  # noqa: E402
from provenance import commit  # noqa: E402

WORDS = ["the", "ferry", "streams", "weights", "to", "a", "device", "and", "back", "while", "models", "learn"]


def write_data(root: Path, rows: int, words: int) -> None:
    """A BPE tokenizer with a chat template, chat rows and preference pairs long enough to fill ``--seq``."""
    from tests.jobs.llm_helpers import save_bpe_tokenizer

    save_bpe_tokenizer(root / "models" / "tok")
    rng = random.Random(0)
    text = lambda n=words: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    data = root / "datasets"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "chat.jsonl").open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"messages": [{"role": "user", "content": text(8)},
                                             {"role": "assistant", "content": text()}]}) + "\n")  # fmt: skip
    with (data / "pairs.jsonl").open("w") as f:
        for _ in range(rows):
            prompt = [{"role": "user", "content": text(8)}]
            f.write(json.dumps({"prompt": prompt, "chosen": [{"role": "assistant", "content": text()}],
                                "rejected": [{"role": "assistant", "content": text()}]}) + "\n")  # fmt: skip


def job(name: str, *, objective: str, args: argparse.Namespace, seq: int) -> dict[str, Any]:
    preference = objective != "sft"
    return {
        "name": name,
        "device": "cpu" if args.cpu else "cuda",
        "model": {"kind": "hf_causal_lm", "path": "qwen2.5-32b-shape", "dtype": "bfloat16", "init": "random"},
        "data": {
            "kind": "text",
            "path": "pairs.jsonl" if preference else "chat.jsonl",
            "format": "preference" if preference else "chat",
            "seq_len": seq,
            "packing": "padded",
            "tokenizer": {"kind": "hf", "path": "tok"},
        },
        "lora": {"target_modules": ALL_LINEAR, "rank": 16},
        "training": {
            "steps": args.steps,
            "batch_size": 1 if preference else 2,
            "learning_rate": 1e-5,
            "gradient_checkpointing": True,
            "mixed_precision": "bf16",  # as configs/hf_causal_lm_dpo-lora_model-offload.yaml: float32 adapters
            "objective": objective,
            **({"dpo": {"beta": 0.1}} if preference else {}),
        },
        "offload": {"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_limit": args.limit},
        "checkpoint": {"save_final": False},
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    shape = scaled(QWEN_32B, args.scale)
    seq = args.seq if args.scale >= 1 else 32
    root = args.out
    write_config(root / "models" / "qwen2.5-32b-shape", shape)
    write_data(root, rows=64, words=4 * seq)
    runs = {}
    for objective in ("sft", "dpo"):
        # Each job in a process of its own: a 32B job's pinned host copy is most of the host's memory, and
        # the next job must find it returned to the system, not waiting on this process's garbage collector.
        result = root / f"{objective}.json"
        command = [sys.executable, __file__, "--out", str(root), "--steps", str(args.steps), "--seq", str(args.seq),
                   "--limit", args.limit, "--scale", str(args.scale), "--only", objective, *(["--cpu"] if args.cpu else [])]  # fmt: skip
        print(f"{objective}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True)
        runs[objective] = json.loads(result.read_text())
    sft, dpo = runs["sft"]["median_step_s"], runs["dpo"]["median_step_s"]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": commit(),
        "tokens": 2 * seq,
        "limit": args.limit,
        "runs": runs,
        "ratio": dpo / sft if sft and dpo else None,
    }


def markdown(r: dict[str, Any]) -> str:
    rows = [
        f"{r['date']}, {r['gpu']}, torch {r['torch']}, commit {r['commit']}; {r['tokens']} tokens a step, "
        f"limit {r['limit']}",
        "",
        "| row | median step | H2D per step | peak allocated / reserved | first loss |",
        "|---|---|---|---|---|",
    ]
    for name, run in r["runs"].items():
        offload = run.get("offload") or {}
        rows.append(
            f"| {name.upper()} LoRA | {run['median_step_s'] or 0:.3f} s | "
            f"{(offload.get('last_step_h2d_bytes') or 0) / 1e9:.2f} GB | {run['device_peak_gib']:.1f} / "
            f"{run['device_reserved_gib']:.1f} GiB | {run['losses'][0]:.4f} |"
        )
    ratio = r["ratio"]
    rows += ["", f"DPO / SFT step: {ratio:.2f}x (target <= 1.15x)." if ratio else "", ""]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row: a step holds two rows")
    parser.add_argument("--limit", default="24GiB")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--only", choices=["sft", "dpo"], help="run one job in this process (used by the others)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only:
        seq = args.seq if args.scale >= 1 else 32
        run = run_in_process(job(f"{args.only}-32b", objective=args.only, args=args, seq=seq), args.out)
        (args.out / "out").rename(args.out / f"out-{args.only}")  # the next job must not resume from this one
        (args.out / f"{args.only}.json").write_text(json.dumps(run, default=str))
        return
    record = measure(args)
    text = markdown(record)
    print(text)
    (args.out / "preference_bench.json").write_text(json.dumps(record, indent=2, default=str))
    (args.out / "preference_bench.md").write_text(text)


if __name__ == "__main__":
    main()
