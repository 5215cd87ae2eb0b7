"""``disk_io``: the disk tier's ``O_DIRECT`` reads (offload/direct_io.py) give the bytes buffered reads give, at
any offset and up to the file's last partial block; a filesystem that refuses ``O_DIRECT`` makes ``auto`` read
through the page cache, said once, and ``direct`` refuse with the setting and the fix named."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from offload import OffloadOptions, OffloadTrainingManager, direct_io
from offload.direct_io import ALIGNMENT, DirectIOUnsupported, open_weights
from offload.disk import CheckpointChanged, DiskSpan, DiskStage, FileRange
from tests.offload.test_disk import Stack, locator

CPU = torch.device("cpu")


def direct_reads_work(folder: Path) -> bool:
    """Whether ``folder``'s filesystem serves O_DIRECT reads (ext4 here; tmpfs before Linux 6.6 does not)."""
    probe = folder / "probe.bin"
    probe.write_bytes(bytes(ALIGNMENT))
    try:
        fd, fallback = open_weights(probe, "auto")
        os.close(fd)
        return fallback is None
    finally:
        probe.unlink()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    if not direct_reads_work(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT reads")
    return tmp_path


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.open as on a filesystem without O_DIRECT (tmpfs before Linux 6.6): EINVAL for the flag."""
    real_open = os.open

    def open_without_direct(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_io.os, "open", open_without_direct)


def train(model: Stack, manager: OffloadTrainingManager, steps: int, width: int) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, width, generator=generator)).pow(2).mean()
        loss.backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def weights_file(folder: Path, nbytes: int) -> tuple[Path, bytes]:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = folder / "weights.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, path.read_bytes()


# [start, end): inside one block, across block boundaries, aligned, and ending at the file's last partial block.
SIZE = 5 * ALIGNMENT + 1234
RANGES = [(0, 7), (3, ALIGNMENT + 5), (ALIGNMENT, 2 * ALIGNMENT), (4095, 4097), (100, SIZE), (SIZE - 3, SIZE)]


@pytest.mark.parametrize(("start", "end"), RANGES)
def test_direct_reads_give_the_bytes_at_any_offset_up_to_the_last_partial_block(
    folder: Path, start: int, end: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("offload.disk.DIRECT_CHUNK_BYTES", 2 * ALIGNMENT)  # several bounce reads per range
    path, data = weights_file(folder, SIZE)
    like = torch.empty(end - start, dtype=torch.uint8)
    copies = {}
    for mode in ("direct", "buffered"):
        stage = DiskStage([path], slots=1, slot_bytes=SIZE, pin=False, device=CPU, disk_io=mode)
        assert stage.files[path].direct == (mode == "direct")
        copies[mode] = stage.read_copy(FileRange(path, start, end), like)
        stage.close()
    assert copies["direct"].numpy().tobytes() == data[start:end]
    assert torch.equal(copies["direct"], copies["buffered"])


def test_a_staged_unit_read_direct_lands_at_its_offsets_in_an_aligned_slot(folder: Path) -> None:
    path, data = weights_file(folder, SIZE)
    pieces = [
        (0, FileRange(path, 3, 1003)),
        (1024, FileRange(path, SIZE - 1500, SIZE)),
        (2560, FileRange(path, 4090, 8200)),
    ]
    span = DiskSpan("unit", pieces, 2560 + 4110)
    stage = DiskStage([path], slots=2, slot_bytes=span.nbytes, pin=False, device=CPU, disk_io="direct")
    assert stage.buffer.data_ptr() % ALIGNMENT == 0 and stage.stride % ALIGNMENT == 0
    slot = stage.take(span)
    for offset, piece in pieces:
        assert slot[offset : offset + piece.nbytes].numpy().tobytes() == data[piece.start : piece.end]
    stage.copied(None)
    stage.close()


def test_a_file_truncated_under_direct_reads_is_an_error_naming_it(folder: Path) -> None:
    path, _ = weights_file(folder, SIZE)
    stage = DiskStage([path], slots=1, slot_bytes=SIZE, pin=False, device=CPU, disk_io="direct")
    os.truncate(path, SIZE - 2000)
    with pytest.raises(CheckpointChanged, match=str(path)):
        stage.read_copy(FileRange(path, 100, SIZE), torch.empty(SIZE - 100, dtype=torch.uint8))
    stage.close()


def test_auto_falls_back_to_buffered_reads_saying_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    refuse_o_direct(monkeypatch)
    path, data = weights_file(tmp_path, SIZE)
    other = tmp_path / "other.bin"
    other.write_bytes(data)
    with caplog.at_level(logging.INFO, logger="offload.disk"):
        stage = DiskStage([path, other], slots=1, slot_bytes=SIZE, pin=False, device=CPU, disk_io="auto")
    assert not any(handle.direct for handle in stage.files.values())
    said = [r.getMessage() for r in caplog.records if "disk_io" in r.getMessage()]
    assert len(said) == 1 and "refuses O_DIRECT" in said[0] and "page cache" in said[0]
    got = stage.read_copy(FileRange(path, 5, SIZE), torch.empty(SIZE - 5, dtype=torch.uint8))
    assert got.numpy().tobytes() == data[5:]
    stage.close()


def test_direct_on_a_filesystem_without_it_is_refused_naming_the_setting_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_o_direct(monkeypatch)
    path, _ = weights_file(tmp_path, SIZE)
    with pytest.raises(DirectIOUnsupported, match=r"offload.disk_io is 'direct'.*set offload.disk_io to 'auto'"):
        DiskStage([path], slots=1, slot_bytes=SIZE, pin=False, device=CPU, disk_io="direct")


def test_disk_io_other_than_the_three_modes_is_refused() -> None:
    with pytest.raises(ValueError, match="disk_io must be 'auto', 'direct' or 'buffered'"):
        OffloadOptions(disk_io="fast")


def test_direct_and_buffered_disk_units_train_bitwise_the_same(folder: Path) -> None:
    path = folder / "model.safetensors"
    torch.manual_seed(0)
    results = {}
    for mode in ("direct", "buffered"):
        torch.manual_seed(0)
        model = Stack(width=256, depth=12)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith(("head", "inp")))
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        options = OffloadOptions(granularity="block", host_memory_limit=full // 2, disk_io=mode)
        manager = OffloadTrainingManager(model, "cpu", options=options, disk=locator(path))
        assert manager.disk_stage is not None and manager.plan.disk_bytes > 0
        assert all(handle.direct == (mode == "direct") for handle in manager.disk_stage.files.values())
        results[mode] = (train(model, manager, 3, width=256), manager.remove().state_dict())
    assert results["direct"][0] == results["buffered"][0]  # losses, bitwise
    for name, tensor in results["direct"][1].items():
        assert torch.equal(tensor, results["buffered"][1][name]), name


def test_auto_reads_buffered_where_only_the_bounce_buffers_would_not_fit_the_limit(folder: Path) -> None:
    from tests.offload.test_disk import saved_model

    path = folder / "model.safetensors"  # units of a few KB: O_DIRECT's bounce buffers would outweigh the ring
    full = OffloadTrainingManager(saved_model(path), "cpu").stats().pinned_reserved_bytes
    options = OffloadOptions(granularity="block", host_memory_limit=full // 2, disk_io="auto")
    manager = OffloadTrainingManager(saved_model(path), "cpu", options=options, disk=locator(path))
    assert manager.plan.disk_io == "buffered" and manager.plan.host_fits and manager.plan.disk_bytes > 0
    assert manager.disk_stage is not None and not any(h.direct for h in manager.disk_stage.files.values())
    with pytest.raises(ValueError, match="host_memory_limit"):  # direct has no such way out
        OffloadTrainingManager(
            saved_model(path), "cpu", options=OffloadOptions(granularity="block", host_memory_limit=full // 2,
            disk_io="direct"), disk=locator(path))  # fmt: skip
