"""The engine's per-step host work: what a step does per tensor once the first step has fixed the schedule.

On the H200 the 60-layer DiT's step is bound by the host issuing kernels (bench/RESULTS.md), so every
Python call the engine makes per tensor is step time. Adapters trained on the device and the weights the
memory budget keeps there never move: they get no saved-tensor tokens and no per-tensor bookkeeping; a
block's tensors are onloaded and offloaded by one walk over its span, not a few method calls per tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadOptions, OffloadTrainingManager
from offload import saved_tensors as saved_tensors_module
from offload.offloaders import TensorOffloader
from tests.offload.models import WIDTH, make_stack, train


def _block_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[1].parameters())


@contextmanager
def _counting(manager: OffloadTrainingManager) -> Iterator[Counter]:
    """Counts saved-tensor tokens by the kind of tensor they stand in for (streamed, kept, adapter) and the
    per-tensor ``acquire``/``release`` calls, while the block runs."""
    counts: Counter = Counter()
    kept = manager._schedule.kept
    token_init = saved_tensors_module.SavedWeight.__init__
    acquire, release = TensorOffloader.acquire, TensorOffloader.release

    def counted_token(self, offloader, view) -> None:  # type: ignore[no-untyped-def]
        kind = "adapter" if offloader.kind == "always_on_device" else "kept" if id(offloader) in kept else "streamed"
        counts[f"token:{kind}"] += 1
        token_init(self, offloader, view)

    def counted_acquire(self) -> None:  # type: ignore[no-untyped-def]
        counts["acquire"] += 1
        acquire(self)

    def counted_release(self, keep_if_saved: bool = False) -> None:  # type: ignore[no-untyped-def]
        counts["release"] += 1
        release(self, keep_if_saved)

    saved_tensors_module.SavedWeight.__init__ = counted_token  # type: ignore[method-assign]
    TensorOffloader.acquire, TensorOffloader.release = counted_acquire, counted_release  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        saved_tensors_module.SavedWeight.__init__ = token_init  # type: ignore[method-assign]
        TensorOffloader.acquire, TensorOffloader.release = acquire, release  # type: ignore[method-assign]


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_after_the_first_step_only_streamed_weights_cost_per_tensor_work(checkpointing: str | None) -> None:
    model = make_stack("adapter", checkpointing)
    budget = _block_bytes(model) + 64  # one block stays on the device; the others stream
    manager = OffloadTrainingManager(
        model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=budget)
    )
    x = torch.randn(4, WIDTH)
    for _ in range(2):  # the first step records the order and applies the budget
        with _counting(manager) as counts:
            F.mse_loss(model(x), x).backward()
            manager.after_backward()
    assert manager._schedule.kept, "the budget kept nothing: the test would not test it"
    assert counts["token:streamed"] > 0  # streamed weights still stand in tokens for backward
    assert counts["token:adapter"] == 0 and counts["token:kept"] == 0
    assert counts["acquire"] == 0 and counts["release"] == 0  # blocks are walked by their span, kept ones skipped


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_training_with_the_shortcuts_equals_training_without_offload(checkpointing: str | None) -> None:
    reference, _, _ = train(make_stack("adapter", checkpointing))
    model = make_stack("adapter", checkpointing)
    options = OffloadOptions(granularity="block", gpu_memory_budget=_block_bytes(model) + 64)
    losses, _, _ = train(model, offload={"options": options})
    assert losses == reference


class _FakeEvent:
    """Stands in for ``torch.cuda.Event`` on a machine without CUDA: counts the events a copy makes."""

    made: ClassVar[list[_FakeEvent]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded = 0
        _FakeEvent.made.append(self)

    def record(self, stream: object = None) -> None:
        self.recorded += 1


class _FakeStream:
    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass


def test_a_side_stream_copy_makes_two_events_its_timing_and_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each CUDA event is created, recorded and destroyed by the host: on a step the host bounds (the LoRA NF4
    step, bench/RESULTS.md) a copy's events are launch time. The copy's timing ends where the copy ends, so
    the timing's end event is what a waiter waits for: two events per copy, not three."""
    import contextlib

    from offload.stats import StatsCounter
    from offload.transfers import CopyEngine

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    copies = CopyEngine(torch.device("cpu"), StatsCounter())
    copies.h2d_stream, copies.d2h_stream = _FakeStream(), _FakeStream()  # type: ignore[assignment]
    _FakeEvent.made.clear()
    host = torch.arange(16.0)
    pending = copies.to_device(host, prefetch=True)
    assert torch.equal(pending.tensor, host)
    assert len(_FakeEvent.made) == 2 and all(e.enable_timing and e.recorded == 1 for e in _FakeEvent.made)
    assert pending.event is _FakeEvent.made[1]  # the timing's end
    _FakeEvent.made.clear()
    back = torch.empty(16)
    done = copies.to_host_async(pending.tensor, back)
    assert torch.equal(back, host)
    assert len(_FakeEvent.made) == 2 and done is _FakeEvent.made[1]


@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant"])
def test_backward_prefetches_a_checkpointed_block_by_its_span_not_tensor_by_tensor(
    monkeypatch: pytest.MonkeyPatch, checkpointing: str
) -> None:
    """A checkpointed block's recompute onloads all of it, so backward's prefetch of the next block is the
    unit's own prefetch, one walk over its span, not one call per tensor (a DiT block has ~40)."""
    model = make_stack("adapter", checkpointing)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", prefetch=1))
    per_tensor: Counter = Counter()
    prefetch = TensorOffloader.prefetch

    def counted(self: TensorOffloader) -> None:
        per_tensor["in a block" if self.group is not None else "elsewhere"] += 1  # elsewhere: what backward unpacks
        prefetch(self)

    x = torch.randn(4, WIDTH)
    F.mse_loss(model(x), x).backward()  # the first step records the order
    manager.after_backward()
    monkeypatch.setattr(TensorOffloader, "prefetch", counted)
    F.mse_loss(model(x), x).backward()
    manager.after_backward()
    assert per_tensor["in a block"] == 0
    assert manager._schedule._backward_prefetch, "backward prefetched nothing: the test would not test it"
    manager.remove()


def test_a_blocks_tensors_sharing_one_copy_event_are_waited_for_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's ~40 tensors arrive in one copy and share its event: the compute stream waits for it once, and
    the tensors after the first cost no ``torch.cuda.current_stream`` (a device guard and a Python ``Stream``
    object each, microseconds per tensor on a step the host bounds). A new event, or another stream, waits."""
    from offload.stats import StatsCounter
    from offload.transfers import CopyEngine, PendingCopy

    current = {"stream": (3, 0, 1)}  # the ids torch._C._cuda_getCurrentStream gives: stream, device, type
    streams_built: list[_FakeStream] = []

    def built(device: object = None) -> _FakeStream:
        streams_built.append(_FakeStream())
        return streams_built[-1]

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", built)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: current["stream"], raising=False)
    copies = CopyEngine(torch.device("cpu"), StatsCounter())
    span = torch.zeros(64)
    first, second = _FakeEvent(), _FakeEvent()
    _FakeEvent.made.clear()
    block = [PendingCopy(span[i : i + 1], first, planned=True) for i in range(40)]
    for pending in block:
        assert copies.wait(pending) is pending.tensor and pending.event is None
    assert len(streams_built) == 1 and len(_FakeEvent.made) == 2  # one wait, timed by two events
    copies.wait(PendingCopy(span, second, planned=True))
    assert len(streams_built) == 2  # another copy's event
    current["stream"] = (4, 0, 1)  # code that runs on another stream (torch.cuda.stream(...))
    copies.wait(PendingCopy(span, second, planned=True))
    assert len(streams_built) == 3
