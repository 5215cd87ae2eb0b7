"""A checkpoint as users have it: a 7B-class model written by ``save_pretrained`` (random values, sharded
safetensors on local disk), trained with LoRA through the offload path under a memory limit and, in the same
run, without offload (``from_pretrained``); the losses must agree, and the load rate stands beside the disk's
own read rate.

    python bench/real_checkpoint.py --out real7b                       # Mistral-7B's shape, 16GiB limit
    python bench/real_checkpoint.py --out real7b --cpu --scale 0.01    # the same path, tiny, anywhere

Prints a markdown table and writes it with the JSON record to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from big_models import ALL_LINEAR, _drop_from_page_cache, corpus, disk_read_gbps, run_in_process  # noqa: E402
from provenance import commit  # noqa: E402

MISTRAL_7B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False}  # fmt: skip
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}  # fmt: skip


def write_with_save_pretrained(directory: Path, shape: dict[str, Any], shard: str) -> dict[str, Any]:
    """Random bf16 weights drawn on the GPU (when there is one) and written by ``save_pretrained`` in shards,
    then dropped from the page cache so that loading reads the disk."""
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(**shape, max_position_embeddings=32768, dtype="bfloat16")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(directory, max_shard_size=shard)
    del model
    shards = sorted(directory.glob("*.safetensors"))
    for path in shards:
        _drop_from_page_cache(path)
    return {"shards": len(shards), "bytes": sum(p.stat().st_size for p in shards),
            "write_s": time.perf_counter() - started}  # fmt: skip


def job_spec(name: str, *, offload: bool, limit: str | None, steps: int, tokens: int, device: str) -> dict[str, Any]:
    return {
        "name": name,
        "device": device,
        "model": {"kind": "hf_causal_lm", "path": "mistral-7b-shape", "dtype": "bfloat16"},
        "data": {"kind": "text", "path": "corpus", "seq_len": tokens},
        "lora": {"target_modules": ALL_LINEAR, "rank": 16},
        "training": {"steps": steps, "batch_size": 1, "learning_rate": 1e-4, "gradient_checkpointing": True},
        "offload": {"enable_model_cpu_offload": offload, "granularity": "block", "gpu_memory_limit": limit},
        "checkpoint": {"save_final": False},
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    shape = MISTRAL_7B if args.scale >= 1 else TINY
    device = "cpu" if args.cpu else "cuda"
    tokens = args.tokens if args.scale >= 1 else 64
    root = args.out
    model_dir = root / "models" / "mistral-7b-shape"
    checkpoint = write_with_save_pretrained(model_dir, shape, "4GB" if args.scale >= 1 else "200KB")
    disk = disk_read_gbps(sorted(model_dir.glob("*.safetensors"))[0])
    corpus(root / "datasets" / "corpus")
    offloaded = run_in_process(
        job_spec("real-7b-offload", offload=True, limit=args.limit, steps=args.steps, tokens=tokens, device=device),
        root,
    )
    (root / "out").rename(root / "out-offloaded")  # the next job must not resume from this one
    resident = run_in_process(
        job_spec("real-7b-resident", offload=False, limit=None, steps=args.steps, tokens=tokens, device=device),
        root,
    )
    diffs = [abs(a - b) for a, b in zip(offloaded["losses"], resident["losses"], strict=True)]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": commit(),
        "shape": shape,
        "tokens": tokens,
        "limit": args.limit,
        "checkpoint": checkpoint,
        "disk": disk,
        "offloaded": offloaded,
        "resident": resident,
        "max_loss_diff": max(diffs),
    }


def markdown(r: dict[str, Any]) -> str:
    off, res, disk = r["offloaded"], r["resident"], r["disk"]
    load = off.get("load") or {}
    losses = lambda job: ", ".join(f"{x:.4f}" for x in job["losses"])  # noqa: E731
    return "\n".join(
        [
            f"{r['date']}, {r['gpu']}, torch {r['torch']}, commit {r['commit']}; {r['checkpoint']['shards']} shards, "
            f"{r['checkpoint']['bytes'] / 1e9:.1f} GB written by save_pretrained in {r['checkpoint']['write_s']:.0f} s; "
            f"{r['tokens']} tokens a step",
            "",
            "| row | losses | median step | peak allocated / reserved | load |",
            "|---|---|---|---|---|",
            f"| LoRA, model offload, limit {r['limit']} | {losses(off)} | {off['median_step_s'] or 0:.3f} s | "
            f"{off['device_peak_gib']:.1f} / {off['device_reserved_gib']:.1f} GiB | {load.get('gb_per_s', 0):.2f} GB/s "
            f"({load.get('seconds', 0):.1f} s, {load.get('source')}) |",
            f"| LoRA, no offload, no limit | {losses(res)} | {res['median_step_s'] or 0:.3f} s | "
            f"{res['device_peak_gib']:.1f} / {res['device_reserved_gib']:.1f} GiB | from_pretrained |",
            f"| disk's own read rate | | | | {disk['gb_per_s']:.2f} GB/s (`{disk['command'].split(' if=')[0]} ...`) |",
            "",
            f"Largest loss difference: {r['max_loss_diff']:.2e}.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--limit", default="16GiB")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = measure(args)
    text = markdown(record)
    print(text)
    (args.out / "real_checkpoint.json").write_text(json.dumps(record, indent=2, default=str))
    (args.out / "real_checkpoint.md").write_text(text)


if __name__ == "__main__":
    main()
