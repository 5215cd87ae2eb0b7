"""Vision-language LoRA SFT at a 7B shape: the offloaded step under a 16 GiB device limit beside the resident one.

A Qwen2.5-VL-7B-shaped model (config only, ``init: random``: no hub is reachable) with a byte-level BPE trained
here and Qwen's image processor, LoRA on the language model, chat rows of solid-colour images. Two jobs through
``run_job``, as the worker runs them: ``resident`` (no offload, the whole model on the GPU) and ``offload``
(model offload, ``offload.gpu_memory_limit: 16GiB``, block units, the budget chosen by the fit check). Prints one
row per mode (median step time after warmup, peak device memory) and the ratio; ``--out`` writes them as JSON.

    python bench/vlm_bench.py --out vlm                     # on the GPU box: 7B shape, resident and offload
    python bench/vlm_bench.py --scale tiny --device cpu     # CPU smoke run of the same path (seconds)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from provenance import commit  # noqa: E402

from jobs import PathRoots, run_job  # noqa: E402
from jobs.spec.loading import load_job_spec  # noqa: E402
from tests.jobs.vlm_helpers import _TEMPLATE, COLOURS, QWEN_IMAGE, _tokenizer, colour_record, solid_png, write_jsonl  # noqa: E402

# Qwen2.5-VL-7B-Instruct's shapes: 8.3B parameters (7.6B language model, 0.7B vision tower).
QWEN_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=32768)  # fmt: skip
QWEN_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      fullatt_block_indexes=[7, 15, 23, 31], window_size=112)  # fmt: skip
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   fullatt_block_indexes=[1], window_size=112)  # fmt: skip


def save_model(directory: Path, scale: str, max_pixels: int) -> None:
    """config.json (no weights: the job draws them), the tokenizer, Qwen's image processor and chat template."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    text, vision = (QWEN_7B_TEXT, QWEN_7B_VISION) if scale == "7b" else (TINY_TEXT, TINY_VISION)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # Qwen's [16, 24, 24] at head_dim 128
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=152064 if scale == "7b" else len(tokenizer), **text,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}),
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    tokenizer.chat_template = _TEMPLATE.replace("@IMAGE@", QWEN_IMAGE)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=max_pixels).save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(tokenizer.chat_template)


def write_data(directory: Path, rows: int, image_size: int) -> None:
    """Rows of solid-colour images (``image_size`` pixels square) asking for their colour."""
    names = list(COLOURS)
    for colour in names:
        solid_png(directory / f"{colour}.png", colour, (image_size, image_size))
    write_jsonl(directory / "train.jsonl", [colour_record(f"{names[i % 4]}.png", names[i % 4]) for i in range(rows)])


def job(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    offload: dict[str, Any] = {"enable_model_cpu_offload": False}
    if mode == "offload":
        offload = {"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_limit": args.limit}
    return {
        "name": f"vlm-{mode}",
        "device": args.device,
        "model": {"kind": "hf_image_text_to_text", "path": "model", "dtype": "bfloat16", "init": "random"},
        "data": {"kind": "image_chat", "path": "data/train.jsonl", "seq_len": args.seq_len},
        "lora": {
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "rank": 16,
        },
        "training": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "learning_rate": 1e-4,
            "gradient_checkpointing": True,
        },
        "offload": offload,
        "checkpoint": {"save_final": False},
    }


def run(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    stamps: list[float] = []
    events: list[Any] = []

    def report(event: Any) -> None:
        if event.type == "step":
            stamps.append(time.perf_counter())
            events.append(event)

    roots = PathRoots(model_roots=[root], data_roots=[root])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    spec = load_job_spec(json.dumps(job(mode, args)), roots=roots)
    run_job(spec, output_dir=root / f"out-{mode}", report=report, resume=False)
    steps = [b - a for a, b in itertools.pairwise(stamps)][args.warmup - 1 :] or [0.0]
    peak = max(e.device_peak_bytes for e in events)
    return {"mode": mode, "step_s": statistics.median(steps), "peak_gib": peak / 2**30, "loss": events[-1].loss,
            "steps_timed": len(steps)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=["7b", "tiny"], default="7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", default="resident,offload")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=896, help="pixels a side: 896 -> 1024 image tokens")
    parser.add_argument("--seq-len", type=int, default=1200)
    parser.add_argument("--limit", default="16GiB", help="offload.gpu_memory_limit of the offload run")
    parser.add_argument("--out", type=Path, help="write the rows as <out>.json")
    args = parser.parse_args()
    if args.scale == "tiny":
        args.image_size, args.batch_size, args.seq_len, args.steps = 56, 2, 256, max(4, min(args.steps, 5))
        args.warmup = min(args.warmup, 2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_model(root / "model", args.scale, max_pixels=args.image_size * args.image_size)
        write_data(root / "data", rows=4 * args.batch_size, image_size=args.image_size)
        rows = [run(mode, args, root) for mode in args.modes.split(",")]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    print(f"| mode | step (s) | peak device (GiB) | loss |   {device}, torch {torch.__version__}, commit {commit()}")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['step_s']:.3f} | {row['peak_gib']:.2f} | {row['loss']:.3f} |")
    by_mode = {row["mode"]: row for row in rows}
    if {"resident", "offload"} <= set(by_mode) and by_mode["resident"]["step_s"] > 0:
        ratio = by_mode["offload"]["step_s"] / by_mode["resident"]["step_s"]
        print(
            f"offload / resident step: {ratio:.2f} x (goal <= 1.10 x), offload peak {by_mode['offload']['peak_gib']:.2f} GiB"
        )
    if args.out is not None:
        meta = {
            "device": device,
            "torch": torch.__version__,
            "commit": commit(),
            "args": vars(args) | {"out": str(args.out)},
        }
        Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
