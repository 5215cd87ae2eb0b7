"""The exports of a 7B-shape LoRA job: how long each takes, how large it is, and the host memory it needs.

A Mistral-7B-shape base (random bf16 weights, sharded by ``save_pretrained``) is trained for two LoRA steps on
every linear layer (a real Ferry job, checkpoint and all); the checkpoint is then exported as each format a
user downloads, every export in its own ``python -m jobs`` process as the service runs them:

- ``merge``: the adapter merged into the base, ``save_pretrained`` in 5 GB shards, and its ``.tar``;
- ``export --quant f16`` / ``q8_0`` / ``q4_k_m``: one GGUF file each (a merge first, then the writer).

    python bench/export_bench.py --out export7b                       # Mistral-7B's shape, on the GPU
    python bench/export_bench.py --out export7b --only q4_k_m         # again, one export (base and job kept)
    python bench/export_bench.py --out export7b --cpu --scale 0.01    # the same path, tiny, anywhere

Prints a markdown table and writes it with the JSON record to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from big_models import ALL_LINEAR, corpus, run_in_process  # noqa: E402
from provenance import commit  # noqa: E402
from real_checkpoint import MISTRAL_7B, write_with_save_pretrained  # noqa: E402

# Rows 256 and 512 wide: the K-quants' super-blocks fit, as in the 7B, so q4_k_m runs its real path.
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}  # fmt: skip
EXPORTS = {
    "merged": ["merge", "--no-archive"],
    "merged_tar": ["merge"],
    "f16": ["export", "--quant", "f16"],
    "q8_0": ["export", "--quant", "q8_0"],
    "q4_k_m": ["export", "--quant", "q4_k_m"],
}


def job_spec(device: str, tokens: int) -> dict[str, Any]:
    return {
        "name": "export-7b",
        "device": device,
        "model": {"kind": "hf_causal_lm", "path": "mistral-7b-shape", "dtype": "bfloat16"},
        "data": {"kind": "text", "path": "corpus", "seq_len": tokens, "tokenizer": {"kind": "hf", "path": "tok"}},
        "lora": {"target_modules": ALL_LINEAR, "rank": 16},
        "training": {"steps": 2, "batch_size": 1, "learning_rate": 1e-4, "gradient_checkpointing": True},
        "checkpoint": {"save_final": True},
    }


def run_export(name: str, arguments: list[str], checkpoint: Path, exports: Path) -> dict[str, Any]:
    """One export in its own process: wall time, its peak resident memory (``wait4``), the files it made."""
    before = {p: p.stat().st_size for p in exports.rglob("*") if p.is_file()} if exports.exists() else {}
    output = exports / name
    target = output if arguments[0] == "merge" else output.with_suffix(".gguf")
    command = [sys.executable, "-m", "jobs", arguments[0], str(checkpoint), *arguments[1:], "--output", str(target)]
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    stderr = child.stderr.read() if child.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {stderr[-2000:]}")
    made = {p: p.stat().st_size for p in exports.rglob("*") if p.is_file() and p not in before}
    return {
        "export": name,
        "seconds": seconds,
        "peak_rss_gb": usage.ru_maxrss / 1e6,  # Linux: kilobytes
        "files": len(made),
        "bytes": sum(made.values()),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tests.jobs.llm_helpers import save_bpe_tokenizer

    shape = MISTRAL_7B if args.scale >= 1 else TINY
    root = args.out
    base = root / "models" / "mistral-7b-shape"
    made = root / "base.json"
    if not made.is_file():  # a second run (other --only exports) reuses the base and the trained checkpoint
        info = write_with_save_pretrained(base, shape, "4GB" if args.scale >= 1 else "200KB")
        save_bpe_tokenizer(root / "models" / "tok")
        corpus(root / "datasets" / "corpus")
        job = run_in_process(job_spec("cpu" if args.cpu else "cuda", 64 if args.scale < 1 else 512), root)
        made.write_text(json.dumps({"base": info, "job": {"status": job["status"], "steps": job["steps"]}}))
    prepared = json.loads(made.read_text())
    checkpoint = sorted((root / "out" / "checkpoints").glob("step-*"))[-1]
    exports = root / "bench-exports"
    exports.mkdir(exist_ok=True)
    rows = [run_export(name, EXPORTS[name], checkpoint, exports) for name in args.only]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "commit": commit(),
        "shape": shape,
        **prepared,
        "exports": rows,
    }


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"{r['date']}, {r['gpu']}, {r['cpus']} CPUs, torch {r['torch']}, commit {r['commit']}; base "
        f"{r['base']['bytes'] / 1e9:.1f} GB bf16 in {r['base']['shards']} shards; LoRA rank 16 on every linear",
        "",
        "| export | time (s) | size (MB) | files | peak host memory (GB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in r["exports"]:
        lines.append(
            f"| {row['export']} | {row['seconds']:.1f} | {row['bytes'] / 1e6:.1f} | {row['files']} "
            f"| {row['peak_rss_gb']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a directory with room for the base and exports")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (with --scale below 1)")
    parser.add_argument("--scale", type=float, default=1.0, help="below 1: a tiny model of the same family")
    parser.add_argument(
        "--only", nargs="+", choices=list(EXPORTS), default=list(EXPORTS), help="these exports (default: all)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = measure(args)
    table = markdown(record)
    print(table)
    tag = "-".join(args.only)
    (args.out / f"export_bench-{tag}.md").write_text(table + "\n")
    (args.out / f"export_bench-{tag}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
