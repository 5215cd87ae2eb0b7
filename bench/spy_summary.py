"""Summarize a py-spy raw profile (``py-spy record --threads --format raw``) of a training job: where the host's
CPU time goes inside the training steps, by thread and by area, and the engine's own share.

The host issues a step from two threads: the main one (forward, optimizer) and, on CUDA, autograd's device
thread (backward). Samples of setup (the main thread outside ``train_step``, loader threads) are left out.
Each sample counts for the area of its innermost Python frame (offload/, jobs/, peft, diffusers, torch, ...).
``engine (own work)``: samples whose innermost Python frame outside torch is the engine's (offload/), so the
torch calls it makes count as its own, the model code it calls into (a saved-tensor hook that recomputes a
checkpointed block) does not. py-spy records a thread only while it is on a core, and a launch that waits
for room in CUDA's queue spins on one: such samples land on whichever model op was being launched.

Run:  py-spy record --nonblocking --threads --format raw -r 100 -o raw.txt -- python bench/diffusion_profile.py ...
      python bench/spy_summary.py raw.txt [more.txt ...]
(``--native`` adds the C++ frames, but at 60 layers it slows the job so much that the run does not finish.)
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

FRAME = re.compile(r"^(?P<name>.*) \((?P<where>[^()]*)\)$")
AREAS = (
    ("offload/", "offload (engine)"),
    ("jobs/", "jobs"),
    ("peft/", "peft"),
    ("diffusers/", "diffusers"),
    ("accelerate/", "accelerate"),
    ("torch/", "torch (Python)"),
)
# Frames that only autograd's backward runs (its Python-facing entry points, or its C++ loop in a native profile).
BACKWARD_MARKERS = ("BackwardCFunction.apply", "_engine_run_backward", "Engine::thread_main")
MAIN, BACKWARD, ENGINE = "main thread (forward, optimizer)", "autograd thread (backward)", "engine (own work)"


def area(where: str) -> str:
    return next((name for marker, name in AREAS if marker in where), "other Python")


def tally(text: str) -> tuple[dict[str, collections.Counter[str]], collections.Counter[str], collections.Counter[str]]:
    """Per thread, samples by area (and the engine's own); the engine's entry frames; the innermost frames."""
    by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    engine: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        head, *frames = stack.split(";")
        if any(f.startswith("train_step (") for f in frames):
            thread = MAIN
        elif "MainThread" not in head and any(marker in f for f in frames for marker in BACKWARD_MARKERS):
            thread = BACKWARD
        else:
            continue
        python = [m for m in (FRAME.match(f) for f in frames) if m and ".py:" in m["where"]]
        by_thread[thread][area(python[-1]["where"]) if python else "native, no Python frame"] += count
        owner = next((m for m in reversed(python) if "torch/" not in m["where"]), None)
        if owner is not None and "offload/" in owner["where"]:
            by_thread[thread][ENGINE] += count
            entry = next(m for m in python if "offload/" in m["where"])
            engine[f"{entry['name']} ({entry['where']})"] += count
        if python:
            leaves[f"{python[-1]['name']} ({python[-1]['where']})"] += count
    return by_thread, engine, leaves


def summarize(path: Path) -> str:
    by_thread, engine, leaves = tally(path.read_text())
    total = sum(v for kinds in by_thread.values() for k, v in kinds.items() if k != ENGINE)
    lines = [f"{path}: {total} samples in the training steps"]
    for thread in (MAIN, BACKWARD):
        kinds = by_thread.get(thread, collections.Counter())
        n = sum(v for k, v in kinds.items() if k != ENGINE)
        lines.append(f"  {thread}: {n} samples")
        for kind, v in kinds.most_common():
            lines.append(f"    {kind:26s} {v:7d}  {v / max(n, 1):6.1%}")
    lines.append("  the engine's entry frames (its own work):")
    lines += [f"    {v:7d}  {name}" for name, v in engine.most_common(15)]
    lines.append("  innermost Python frames:")
    lines += [f"    {v:7d}  {name}" for name, v in leaves.most_common(25)]
    return "\n".join(lines)


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        print(summarize(Path(argument)))
