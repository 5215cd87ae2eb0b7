"""Small builders shared by the jobs tests: specs from dicts, tiny text corpora, tiny Hugging Face models."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from jobs import JobSpec, PathRoots, load_job_spec, run_job
from jobs.events import event_to_wire

TOY: dict[str, Any] = {
    "name": "toy",
    "device": "cpu",
    "model": {"kind": "toy_mlp", "hidden_size": 32, "num_layers": 3},
    "data": {"kind": "synthetic_regression"},
    "training": {"steps": 10, "batch_size": 8, "learning_rate": 1e-2},
}

TINY_LM: dict[str, Any] = {
    "name": "tiny-lm",
    "device": "cpu",
    "model": {
        "kind": "transformer_lm",
        "vocab_size": 257,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "max_seq_len": 64,
        "dropout": 0.1,
    },
    "data": {"kind": "text", "path": "corpus", "seq_len": 32},
    "training": {"steps": 10, "batch_size": 2, "learning_rate": 1e-3},
}


def merged(base: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A deep copy of ``base`` with sections replaced or (for dicts) updated."""
    data = copy.deepcopy(base)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return data


def spec_from(data: dict[str, Any], roots: PathRoots | None = None) -> JobSpec:
    return load_job_spec(yaml.safe_dump(data), roots=roots)


def write_corpus(directory: Path, documents: int = 40) -> Path:
    """A JSONL file and a text file of varied sentences under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "offload",
        "streams",
        "weights",
        "to",
        "the",
        "device",
    ]
    generator = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(documents):
        picks = torch.randint(len(words), (24,), generator=generator).tolist()
        lines.append(json.dumps({"text": " ".join(words[i] for i in picks)}))
    (directory / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    (directory / "notes.txt").write_text("Ferry trains models larger than the GPU. " * 20)
    return directory


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    """The weights file of the newest checkpoint under ``output_dir``."""
    newest = sorted((output_dir / "checkpoints").glob("step-*"))[-1]
    weights = next(p for p in newest.iterdir() if p.suffix == ".safetensors")
    return load_file(str(weights))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def python_calls(run: Callable[[], object]) -> int:
    """The Python function calls ``run()`` makes (``sys.setprofile``): deterministic, unlike its wall time."""
    calls = 0

    def count(_frame: object, event: str, _arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def losses_and_saved(spec: JobSpec, output_dir: Path, saved: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A job run to success: its step losses, and the tensors of the file ``saved`` in its last checkpoint."""
    events: list[dict[str, Any]] = []
    outcome = run_job(spec, output_dir=output_dir, report=lambda event: events.append(event_to_wire(event)))
    assert outcome.status == "succeeded", events[-1]
    assert outcome.checkpoint is not None
    return [e["loss"] for e in events if e["type"] == "step"], load_file(str(Path(outcome.checkpoint) / saved))
