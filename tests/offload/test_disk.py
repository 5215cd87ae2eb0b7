"""The disk tier: frozen units read from their safetensors files on each use train exactly as held in RAM,
and a file that changes under the job fails it, naming the file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from offload import OffloadOptions, OffloadTrainingManager
from offload.disk import CheckpointChanged, FileRange


class Stack(nn.Module):
    """Frozen blocks (the base) between a small trainable input layer and head (the adapters): the backward
    runs through every frozen block, which onloads its weights again."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def saved_model(path: Path, seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    model = Stack()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(("head", "inp")))
    return model


def locator(path: Path):
    """(name, tensor) -> its bytes in ``path``, from the safetensors header."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    base = 8 + length

    def locate(name: str, tensor: torch.Tensor) -> FileRange | None:
        entry = header.get(name)
        if entry is None:
            return None
        start, end = entry["data_offsets"]
        return FileRange(path, base + start, base + end)

    return locate


def train(model: Stack, manager: OffloadTrainingManager, steps: int, after_step=None) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 64, generator=generator)
        loss = model(x).pow(2).mean()
        loss.backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


@pytest.mark.parametrize("granularity", ["block", "leaf"])
def test_disk_units_train_as_units_in_ram(tmp_path: Path, granularity: str) -> None:
    path = tmp_path / "model.safetensors"
    in_ram = saved_model(path)
    ram = OffloadTrainingManager(in_ram, "cpu", options=OffloadOptions(granularity=granularity))
    expected = train(in_ram, ram, 6)
    full = ram.stats().pinned_reserved_bytes

    on_disk = saved_model(path)
    options = OffloadOptions(granularity=granularity, host_memory_limit=full // 2)
    manager = OffloadTrainingManager(on_disk, "cpu", options=options, disk=locator(path))
    assert manager.plan.disk_bytes > 0 and manager.plan.host_bytes <= full // 2
    losses = train(on_disk, manager, 6)
    stats = manager.stats()

    assert losses == expected  # bitwise, step by step
    assert torch.equal(on_disk.head.weight, in_ram.head.weight) and torch.equal(on_disk.inp.weight, in_ram.inp.weight)
    assert stats.disk_read_bytes > 0 and stats.disk_weight_bytes == manager.plan.disk_bytes
    assert stats.pinned_reserved_bytes <= full // 2
    restored = manager.remove()  # read back from the file: the model as it was
    for (name, a), b in zip(restored.state_dict().items(), in_ram.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_meta_model_on_disk_needs_no_initialize_for_its_disk_weights(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    in_ram = saved_model(path)
    ram = OffloadTrainingManager(in_ram, "cpu", options=OffloadOptions(granularity="block"))
    expected = train(in_ram, ram, 4)
    with torch.device("meta"):
        meta = Stack()
    real = saved_model(path)
    meta.head, meta.inp = real.head, real.inp  # the trainable part, real
    for name, param in meta.named_parameters():
        param.requires_grad_(name.startswith(("head", "inp")))
    locate = locator(path)
    filled: list[str] = []

    def initialize(name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:  # what the disk leaves in RAM
        filled.append(name)
        source = locate(name, tensor)
        assert source is not None
        with path.open("rb") as handle:
            handle.seek(source.start)
            host.view(-1).view(torch.uint8).copy_(
                torch.frombuffer(bytearray(handle.read(source.nbytes)), dtype=torch.uint8)
            )

    options = OffloadOptions(granularity="block", host_memory_limit=ram.stats().pinned_reserved_bytes // 2)
    manager = OffloadTrainingManager(meta, "cpu", options=options, disk=locate, initialize=initialize)
    assert train(meta, manager, 4) == expected
    on_disk = {n for layout in manager.plan.layouts if layout.disk for n in [layout.name]}
    assert on_disk and not any(name.startswith(tuple(on_disk)) for name in filled)


@pytest.mark.parametrize("fault", ["truncated", "rewritten"])
def test_a_changed_checkpoint_fails_with_the_file_named(tmp_path: Path, fault: str) -> None:
    path = tmp_path / "model.safetensors"
    model = saved_model(path)
    full = OffloadTrainingManager(saved_model(tmp_path / "other.safetensors"), "cpu").stats().pinned_reserved_bytes
    manager = OffloadTrainingManager(
        model, "cpu", options=OffloadOptions(granularity="block", host_memory_limit=full // 2), disk=locator(path)
    )

    def damage(step: int) -> None:
        if step != 2:
            return
        if fault == "truncated":
            os.truncate(path, path.stat().st_size // 2)
        else:  # the same size, other bytes (a new save of another model over it)
            data = bytearray(path.read_bytes())
            data[-4096:] = bytes(4096)
            path.write_bytes(bytes(data))

    with pytest.raises(CheckpointChanged, match=str(path)):
        train(model, manager, 6, after_step=damage)


def test_a_limit_below_what_the_disk_can_take_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    model = saved_model(path)
    with pytest.raises(ValueError, match="host_memory_limit is 1.0 KiB but the engine's pinned host memory needs"):
        OffloadTrainingManager(model, "cpu", options=OffloadOptions(host_memory_limit=1024), disk=locator(path))


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_on_cuda_disk_units_train_as_units_in_ram(tmp_path: Path, prefetch: int) -> None:
    """The staging ring is page-locked and refilled only after the side-stream copy that read it has run."""
    path = tmp_path / "model.safetensors"

    def run(limit: int | None) -> tuple[list[float], OffloadTrainingManager, Stack]:
        model = saved_model(path)
        options = OffloadOptions(granularity="block", prefetch=prefetch, host_memory_limit=limit)
        manager = OffloadTrainingManager(model, "cuda", options=options, disk=locator(path) if limit else None)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(6):
            loss = model(torch.randn(8, 64, generator=generator).cuda()).pow(2).mean()
            loss.backward()
            manager.after_backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, manager, model

    expected, ram, _ = run(None)
    losses, manager, _ = run(ram.stats().pinned_reserved_bytes // 2)
    assert losses == expected and manager.stats().disk_read_bytes > 0
    assert manager.disk_stage is not None and manager.disk_stage._registered
