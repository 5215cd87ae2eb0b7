"""Step time of a job through ``run_job``, to compare ``distributed.world_size`` settings, or one tree's
code with another's (run it with ``PYTHONPATH`` pointing at the other tree).

    python bench/data_parallel_bench.py configs/toy_mlp_full_optimizer-offload.yaml --steps 40
    python bench/data_parallel_bench.py configs/toy_mlp_full_optimizer-offload.yaml --world-size 2

Prints one JSON line: the median step time after ``--warmup`` steps, the samples per second of the global
batch, and with several ranks each rank's median step time, and its host RSS and CPU optimizer state at the
last step. No checkpoint is written (save_final: false).

    python bench/data_parallel_bench.py configs/toy_mlp_full_optimizer-offload.yaml --device cpu --world-size 2 \
        --hidden-size 4096 --num-layers 8 --batch-size 8 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from jobs import load_job_spec, run_job
from jobs.events import StepEvent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=None, help="set distributed.world_size (absent: untouched)")
    parser.add_argument("--device", default=None, help="set device (absent: the config's)")
    parser.add_argument("--batch-size", type=int, default=None, help="set training.batch_size (rows per rank)")
    parser.add_argument("--hidden-size", type=int, default=None, help="set model.hidden_size")
    parser.add_argument("--num-layers", type=int, default=None, help="set model.num_layers")
    args = parser.parse_args()
    data: dict[str, Any] = yaml.safe_load(args.config.read_text())
    training = data.setdefault("training", {})
    training.pop("epochs", None)
    training["steps"] = args.steps
    data["checkpoint"] = {"save_final": False}
    data["tracking"] = {"tensorboard": False}
    if args.device is not None:
        data["device"] = args.device
    if args.world_size is not None:
        data["distributed"] = {"world_size": args.world_size}
    if args.batch_size is not None:
        training["batch_size"] = args.batch_size
    for key, value in (("hidden_size", args.hidden_size), ("num_layers", args.num_layers)):
        if value is not None:
            data["model"][key] = value
    steps: list[StepEvent] = []
    with tempfile.TemporaryDirectory() as output:
        outcome = run_job(
            load_job_spec(yaml.safe_dump(data)),
            output_dir=output,
            report=lambda event: steps.append(event) if isinstance(event, StepEvent) else None,
        )
    timed = steps[args.warmup :]
    step_s = [_step_s(a, b) for a, b in zip(steps[args.warmup - 1 :], timed, strict=False)]
    result = {
        "config": str(args.config),
        "world_size": args.world_size or data.get("distributed", {}).get("world_size", 1),
        "status": outcome.status,
        "steps_timed": len(step_s),
        "median_step_s": round(statistics.median(step_s), 5),
        "median_samples_per_s": round(statistics.median(e.samples_per_s for e in timed), 1),
        "peak_device_bytes": max(e.device_peak_bytes for e in steps),
    }
    ranks = [e.ranks for e in timed if getattr(e, "ranks", None)]
    if ranks:
        result["rank_median_step_s"] = [
            round(statistics.median(r[i].step_s for r in ranks), 5) for i in range(len(ranks[0]))
        ]
        result["rank_host_rss_bytes"] = [r.host_rss_bytes for r in ranks[-1]]
        # Each rank's CPU optimizer state (null where the code measured has no such figure)
        result["rank_optimizer_host_bytes"] = [getattr(r, "optimizer_host_bytes", None) for r in ranks[-1]]
    else:
        result["host_rss_bytes"] = timed[-1].host_rss_bytes
        result["optimizer_host_bytes"] = getattr(timed[-1].offload, "optimizer_host_bytes", None)
    result["pinned_bytes"] = timed[-1].pinned_bytes
    print(json.dumps(result))


def _step_s(before: StepEvent, after: StepEvent) -> float:
    return after.elapsed_s - before.elapsed_s


if __name__ == "__main__":
    main()
