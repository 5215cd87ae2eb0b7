"""The CPU optimizer's state on disk (``attach_optimizer(swap_folder=...)``, offload/optimizer_swap.py): training
is bitwise the run with the state in memory, the state between steps lives in its files (read back through
their maps by ``state_dict``), and a damaged file or a full disk stops the job naming the file."""

from __future__ import annotations

import copy
import errno
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadOptions, OffloadTrainingManager
from offload.direct_io import ALIGNMENT, DirectIOUnsupported
from offload.optimizer_swap import OptimizerSwap, SwapFileDamaged, SwapWriteFailed
from tests.offload.models import WIDTH, make_stack
from tests.offload.test_direct_io import direct_reads_work, refuse_o_direct

STEPS = 5
SWAPS: list[OptimizerSwap] = []  # the engines' swaps, in the order train() made them


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, WIDTH, generator=generator) for _ in range(STEPS)]


def train(
    model: torch.nn.Module, swap: Path | None, steps: int = STEPS, read_ahead: int = 2, disk_io: str = "auto"
) -> tuple:
    """Optimizer offload over ``steps`` steps; returns the losses, the weights, the optimizer state dict and the
    engine's last statistics."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = OffloadOptions(disk_io=disk_io)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, options=options)
    manager.attach_optimizer(optimizer, swap_folder=swap, swap_read_ahead=read_ahead)
    if manager.optimizer_swap is not None:
        SWAPS.append(manager.optimizer_swap)
    losses = []
    for x in batches()[:steps]:
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = copy.deepcopy(optimizer.state_dict())  # through the swap files' maps
    stats = manager.stats()
    manager.remove()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, state, stats


def assert_same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for key, entry in a["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, b["state"][key][name]), (key, name)


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_state_on_disk_trains_bitwise_as_in_memory(tmp_path: Path, read_ahead: int) -> None:
    model = make_stack("full", None)
    ram_losses, ram_weights, ram_state, ram_stats = train(copy.deepcopy(model), None)
    losses, weights, state, stats = train(model, tmp_path / "swap", read_ahead=read_ahead)

    assert losses == ram_losses
    for name, value in ram_weights.items():
        assert torch.equal(weights[name], value), name
    assert_same_state(state, ram_state)
    moments = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    assert stats.optimizer_swap_bytes >= moments and stats.optimizer_swap_read_bytes >= (STEPS - 1) * moments
    assert stats.optimizer_host_bytes < ram_stats.optimizer_host_bytes  # the ring and the scalar steps
    assert not (tmp_path / "swap").exists()  # remove() deletes the files it made


def test_between_steps_the_state_is_in_its_files_and_resumes_from_a_state_dict(tmp_path: Path) -> None:
    model = make_stack("full", None)
    reference = copy.deepcopy(model)
    _, ram_weights, ram_state, _ = train(reference, None)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer, swap_folder=tmp_path / "swap")
    data = batches()
    for x in data[:2]:
        F.mse_loss(model(x), x + 1).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = copy.deepcopy(optimizer.state_dict())
    swapped = manager._stepper.swap  # type: ignore[union-attr]
    assert swapped is not None and len(list((tmp_path / "swap").iterdir())) == len(list(model.parameters()))
    manager.remove(copy=True)  # the state read back into memory of its own
    moment = next(iter(optimizer.state.values()))["exp_avg"]
    assert moment.untyped_storage().nbytes() < 2**20 or moment.is_contiguous()

    # A new engine over the same model, the saved state loaded before attaching (as a resumed job does).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.load_state_dict(saved)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer, swap_folder=tmp_path / "swap")
    for x in data[2:]:
        F.mse_loss(model(x), x + 1).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_same_state(optimizer.state_dict(), ram_state)
    manager.remove()
    for name, value in ram_weights.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_swap_file_truncated_mid_run_stops_it_naming_the_file(tmp_path: Path) -> None:
    model = make_stack("full", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer, swap_folder=tmp_path / "swap")
    data = batches()
    victim: Path | None = None
    with pytest.raises(RuntimeError, match="optimizer state swap file .* changed on disk|was truncated") as failed:
        for step, x in enumerate(data):
            F.mse_loss(model(x), x + 1).backward()
            manager.after_backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                manager.wait_for_optimizer()
                victim = sorted((tmp_path / "swap").iterdir())[-1]
                os.truncate(victim, victim.stat().st_size // 2)
        manager.wait_for_optimizer()
    assert victim is not None and str(victim) in str(failed.value)
    assert isinstance(failed.value.__cause__, SwapFileDamaged)


def test_a_full_disk_while_writing_state_stops_it_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_stack("full", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer, swap_folder=tmp_path / "swap")
    x = batches()[0]
    F.mse_loss(model(x), x + 1).backward()
    manager.after_backward()
    optimizer.step()
    manager.wait_for_optimizer()  # the first step's state written

    def no_space(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_space)
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="No space left on device") as failed:
        F.mse_loss(model(x), x + 1).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.state_dict()  # a checkpoint: every write must have landed
    cause = failed.value if isinstance(failed.value, SwapWriteFailed) else failed.value.__cause__
    assert isinstance(cause, SwapWriteFailed)
    assert str(tmp_path / "swap") in str(cause) and "offload.host_memory_limit" in str(cause)


def test_the_ring_reads_ahead_in_the_learned_order(tmp_path: Path) -> None:
    """Keys swapped in the same order each round: after the first round every read but the first is ahead."""
    swap = OptimizerSwap(tmp_path / "swap", slots=3)
    states = {key: {"step": torch.tensor(0.0), "m": torch.full((1000,), float(key))} for key in range(6)}
    for key, state in states.items():
        swap.swap_in(key, state)
        swap.swap_out(key, f"p{key}", state)
    for _ in range(3):
        for key, state in states.items():
            swap.swap_in(key, state)
            assert torch.equal(state["m"], torch.full((1000,), float(key) + _))
            state["m"].add_(1.0)
            swap.swap_out(key, f"p{key}", state)
    swap.flush()
    assert swap.demand_reads == 1  # the first of the rounds read back: the order is not known before it
    assert swap.unused_reads == 2  # the next round's first two, read ahead, dropped by the flush
    assert all(torch.equal(s["m"], torch.full((1000,), float(k) + 3)) for k, s in states.items())
    swap.close()


def o_direct_is_set(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_direct_and_buffered_swap_files_train_bitwise_the_same_laid_out_for_o_direct(tmp_path: Path) -> None:
    if not direct_reads_work(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    model = make_stack("full", None)
    SWAPS.clear()
    direct = train(copy.deepcopy(model), tmp_path / "direct", disk_io="direct")
    buffered = train(model, tmp_path / "buffered", disk_io="buffered")

    assert [s.direct for s in SWAPS] == [True, False] and SWAPS[0].fallback is None
    files = SWAPS[0].files.values()
    assert files
    for swap_file in files:  # every state tensor's bytes start and end on O_DIRECT's unit
        assert swap_file.nbytes % ALIGNMENT == 0 and all(o % ALIGNMENT == 0 for o in swap_file.offsets.values())
    assert SWAPS[0].read_bytes > 0 and SWAPS[0].written_bytes == SWAPS[1].written_bytes
    assert direct[0] == buffered[0]  # losses, bitwise
    for name, value in buffered[1].items():
        assert torch.equal(direct[1][name], value), name
    assert_same_state(direct[2], buffered[2])


def test_swap_files_are_opened_with_o_direct_where_disk_io_asks(tmp_path: Path) -> None:
    if not direct_reads_work(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    for mode, expected in (("direct", True), ("auto", True), ("buffered", False)):
        swap = OptimizerSwap(tmp_path / mode, slots=2, disk_io=mode)
        state = {"step": torch.tensor(1.0), "m": torch.arange(1000.0)}
        swap.swap_out(0, "p", state)  # a state made in memory: written at once through its own file
        swap.swap_in(0, state)
        assert torch.equal(state["m"], torch.arange(1000.0))
        assert o_direct_is_set(swap.files[0].fd) == expected and not list((tmp_path / mode).glob(".o_direct*"))
        swap.swap_out(0, "p", state)
        swap.flush()
        swap.close()


def test_auto_swaps_through_the_page_cache_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_stack("full", None)
    ram = train(copy.deepcopy(model), None)
    refuse_o_direct(monkeypatch)
    SWAPS.clear()
    swapped = train(model, tmp_path / "swap", disk_io="auto")
    assert not SWAPS[0].direct and "refuses O_DIRECT" in str(SWAPS[0].fallback)
    assert swapped[0] == ram[0] and swapped[3].optimizer_swap_read_bytes > 0


def test_direct_swap_where_o_direct_is_refused_fails_at_attach_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_o_direct(monkeypatch)
    model = make_stack("full", None)
    manager = OffloadTrainingManager(
        model, "cpu", enable_optimizer_cpu_offload=True, options=OffloadOptions(disk_io="direct")
    )
    with pytest.raises(DirectIOUnsupported, match=r"offload.disk_io is 'direct'.*set offload.disk_io to 'auto'") as no:
        manager.attach_optimizer(torch.optim.AdamW(model.parameters()), swap_folder=tmp_path / "swap")
    assert "optimizer_swap/ folder) on a local disk" in str(no.value)
    assert not list((tmp_path / "swap").iterdir())  # the probe leaves nothing behind
