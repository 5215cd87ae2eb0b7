"""The public API: bad input is refused with a ValueError naming the argument; the seed's example runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
from offload import OffloadOptions, OffloadTrainingManager, parse_bytes
from tests.offload.models import make_stack

SEED = Path(__file__).resolve().parents[3] / "shared" / "seed" / "Offload_Training.zh.md"
# A verbatim copy of the seed's last code block, so the example also runs where ../shared is absent.
SEED_EXAMPLE = Path(__file__).with_name("seed_toy_example.py.txt")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_device": "warp-drive"}, "target_device='warp-drive' is not a torch device"),
        ({"target_device": "cpu", "cpu_offload_split_threshold": 0}, "cpu_offload_split_threshold must be a positive"),
        ({"target_device": "cpu", "cpu_offload_split_threshold": -5}, "cpu_offload_split_threshold must be a positive"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        OffloadTrainingManager(make_stack("full", None), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="CUDA is not available here; use target_device='cpu'"):
        OffloadTrainingManager(make_stack("full", None), "cuda")


def test_model_without_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="model has no parameters"):
        OffloadTrainingManager(nn.ReLU(), "cpu")


def test_model_on_another_device_is_refused() -> None:
    model = make_stack("full", None)
    model.head.to("meta")  # stands in for a GPU in CI
    with pytest.raises(ValueError, match=r"'head.weight' is on meta.*call model.to\('cpu'\)"):
        OffloadTrainingManager(model, "cpu")


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="prefetch must be an integer >= 0"):
        OffloadOptions(prefetch=-1)
    with pytest.raises(ValueError, match="granularity must be 'leaf' or 'block'"):
        OffloadOptions(granularity="layer")
    with pytest.raises(ValueError, match="gpu_memory_budget must be a byte count"):
        OffloadOptions(gpu_memory_budget="lots")
    assert OffloadOptions(gpu_memory_budget="8GiB").gpu_memory_budget == 8 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes(123) == 123 and parse_bytes(None) is None


def test_public_names() -> None:
    for name in (
        "OffloadTrainingManager",
        "StaticParamOffloader",
        "TrainableParamOffloader",
        "AlwaysOnGPUParamOffloader",
        "BufferOffloader",
        "PinnedArenaPool",
        "OffloadStats",
    ):
        assert name in offload.__all__


def test_stats_and_repr() -> None:
    model = make_stack("adapter", None)
    manager = OffloadTrainingManager(model, "cpu")
    stats = manager.stats().as_dict()
    assert stats["pinned_requested_bytes"] > 0 and stats["pinned_reserved_bytes"] >= stats["pinned_requested_bytes"]
    assert "device=cpu" in repr(manager) and "OffloadUnit(" in repr(manager.units[0])


def seed_example(device: str, shrink: bool) -> str:
    """The seed's offload example, verbatim but for the import (and, on the CPU, the sizes)."""
    code = SEED_EXAMPLE.read_text(encoding="utf-8")
    assert "from diffsynth.core import OffloadTrainingManager" in code
    code = code.replace(
        "from diffsynth.core import OffloadTrainingManager", "from offload import OffloadTrainingManager"
    )
    if shrink:
        code = code.replace("4096", "64").replace("512", "16").replace("range(100)", "range(5)")
    return code.replace('"cuda"', f'"{device}"')


@pytest.mark.skipif(not SEED.exists(), reason="the seed document sits in ../shared beside the checkout")
def test_seed_example_copy_is_verbatim() -> None:
    text = SEED.read_text(encoding="utf-8")
    assert re.findall(r"```python\n(.*?)```", text, flags=re.S)[-1] == SEED_EXAMPLE.read_text(encoding="utf-8")


def test_seed_toy_example_runs_on_cpu() -> None:
    namespace: dict = {}
    exec(compile(seed_example("cpu", shrink=True), "seed_example", "exec"), namespace)
    assert namespace["offload_manager"].stats().steps == 5


@pytest.mark.gpu
def test_seed_toy_example_runs_verbatim_on_gpu() -> None:
    namespace: dict = {}
    exec(compile(seed_example("cuda", shrink=False), "seed_example", "exec"), namespace)
    assert namespace["offload_manager"].stats().steps == 100
    assert namespace["loss"].item() < 1.0
