"""The offload engine's Python overhead per step, on the CPU: a deep model made so narrow that compute is
negligible, run through ``jobs.run_job`` without offload and with leaf and block units.

    python bench/engine_overhead.py                     # the 1.8B LoRA config's 60 layers, 32 wide
    python bench/engine_overhead.py --config transformer_lm-7b_lora_model-offload.yaml

Same layers, modules, LoRA adapters, checkpointing and hooks as the config; only widths, vocabulary and
sequence length shrink, on one CPU thread. The difference between the rows is what the engine's hooks and
bookkeeping cost in Python per step, which a GPU step pays as well (its copies come on top).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from pathlib import Path

import torch
from gpu_e2e import spec_from, write_corpus

from jobs import PathRoots, load_job_spec, run_job
from jobs.events import JobEvent, StepEvent

MODES = {
    "no offload": {"enable_model_cpu_offload": False},
    "offload, leaf units": {"enable_model_cpu_offload": True, "granularity": "leaf", "gpu_memory_budget": None},
    "offload, block units": {"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_budget": None},
}


def median_step_ms(config: str, offload: dict, steps: int, root: Path) -> float:
    text = spec_from(
        config,
        device="cpu",
        model={"hidden_size": 32, "num_heads": 2, "vocab_size": 300, "dtype": "float32", "intermediate_size": 128},
        training={"steps": steps, "epochs": None, "mixed_precision": "no", "batch_size": 1},
        data={"path": "corpus", "seq_len": 8},
        offload=offload,
        checkpoint={"save_final": False},
    )
    events: list[JobEvent] = []
    out = Path(tempfile.mkdtemp(dir=root))
    run_job(
        load_job_spec(text, roots=PathRoots(model_roots=[root], data_roots=[root])),
        output_dir=out,
        report=events.append,
    )
    elapsed = [e.elapsed_s for e in events if isinstance(e, StepEvent)]
    return 1000 * statistics.median([b - a for a, b in itertools.pairwise(elapsed)][1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="transformer_lm_lora_model-offload.yaml", help="a file in configs/")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ferry-overhead-"))
    write_corpus(root / "corpus")
    rows = [(mode, median_step_ms(args.config, offload, args.steps, root)) for mode, offload in MODES.items()]
    base = rows[0][1]
    print(f"{args.config}, 32 wide, CPU, torch {torch.__version__}\n")
    print("| mode | median step (ms) | over no offload (ms) |\n|---|---|---|")
    for mode, ms in rows:
        print(f"| {mode} | {ms:.1f} | {ms - base:+.1f} |")


if __name__ == "__main__":
    main()
