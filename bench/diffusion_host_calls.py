"""Count the Python calls a training step of a tiny DiT makes, by area, under cProfile (CPU, no GPU needed).

The H200's 60-layer DiT step is bound by the host issuing kernels (bench/RESULTS.md), so host work the engine
adds per step is step time. Wall time on a shared CPU box is too noisy to compare engines; call counts are
not. Steps 3-6 of a job are profiled (the first step records the schedule and applies the budget).

Run:  python bench/diffusion_host_calls.py --layers 60 --budget 1.5MiB     (offloaded, ~1/3 of blocks kept)
      python bench/diffusion_host_calls.py --layers 60 --resident
Prints calls and self time per step by area (offload/, torch's checkpoint, peft, diffusers, builtins, ...) and
the engine's functions (``--save p.prof`` keeps the profile, e.g. for ``pstats``' callers). Nothing is
written to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.diffusion_bench import dit_job, make_pipeline_dir, write_synthetic_cache
from jobs import PathRoots, load_job_spec, run_job
from jobs.events import event_to_wire

PROFILED = 4  # steps 3..6


def area(filename: str) -> str:
    for marker, name in (("/offload/", "offload"), ("/peft/", "peft"), ("/diffusers/", "diffusers")):
        if marker in filename:
            return name
    if "torch/utils/checkpoint.py" in filename:
        return "torch checkpoint"
    if "torch/nn/" in filename:
        return "torch.nn"
    return "builtin (C)" if filename == "~" else "other Python"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--budget", default=None, help="offload.gpu_memory_budget (tiny DiT: ~76 KiB a block)")
    parser.add_argument("--resident", action="store_true", help="no offload")
    parser.add_argument("--save", type=Path, default=None, help="also write the profile here (pstats, for callers)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ferry-host-calls-"))
    models, data = work / "models", work / "data"
    data.mkdir(parents=True)
    pipeline = make_pipeline_dir(models / "dit", tiny=True)
    config_path = pipeline / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_layers": args.layers}))
    write_synthetic_cache(
        data / "dit-cache", pipeline, samples=4, side=64, prompt_tokens=64, dim=config["joint_attention_dim"]
    )
    offload: dict[str, Any] = (
        {}
        if args.resident
        else {
            "enable_model_cpu_offload": True,
            "granularity": "block",
            "prefetch": 1,
            "gpu_memory_budget": args.budget or None,  # unset: every unit streamed
        }
    )
    spec = dit_job("host-calls", "dit", steps=PROFILED + 3, device="cpu", offload=offload)
    profile = cProfile.Profile()

    def report(event: Any) -> None:
        wire = event_to_wire(event)
        if wire["type"] == "step" and wire["step"] == 2:
            profile.enable()
        elif wire["type"] == "step" and wire["step"] == 2 + PROFILED:
            profile.disable()

    roots = PathRoots(model_roots=[models], data_roots=[data])
    run_job(load_job_spec(yaml.safe_dump(spec), roots), output_dir=work / "out", report=report)
    if args.save is not None:
        profile.dump_stats(args.save)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    by_area: dict[str, list[float]] = {}
    for (filename, _, _), (_, calls, self_s, _, _) in stats.items():
        totals = by_area.setdefault(area(filename), [0, 0.0])
        totals[0] += calls
        totals[1] += self_s
    total_calls = sum(calls for calls, _ in by_area.values())
    label = "resident" if args.resident else f"offloaded (budget {args.budget})"
    print(f"{label}, {args.layers} layers: {total_calls / PROFILED:.0f} Python calls per step")
    for name, (calls, self_s) in sorted(by_area.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:18s} {calls / PROFILED:9.0f} calls  {self_s / PROFILED:.3f} s self time (cProfile)")
    engine = [
        (v[1], v[2], f"{k[0].split('/offload/')[-1]}:{k[1]}:{k[2]}") for k, v in stats.items() if "/offload/" in k[0]
    ]
    for calls, self_s, name in sorted(engine, reverse=True)[:15]:
        print(f"    {calls / PROFILED:8.0f} calls  {self_s / PROFILED:.4f} s  {name}")


if __name__ == "__main__":
    main()
