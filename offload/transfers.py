"""Copies between host and device, counted and timed. The one place bytes cross the link.

On CUDA, prefetches and gradient copies run on their own streams so they overlap with compute; the compute
stream waits on a CUDA event only when it needs the data (no host synchronization in the steady state).
"""

from __future__ import annotations

import torch

from offload.stats import StatsCounter


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. a checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class PendingCopy:
    """A device copy that may still be in flight on the copy stream. ``planned``: it lives in the device ring
    (never freed, so the allocator needs no stream bookkeeping for it)."""

    __slots__ = ("event", "planned", "tensor")

    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event | None, planned: bool = False) -> None:
        self.tensor = tensor
        self.event = event
        self.planned = planned


class CopyEngine:
    """Makes device copies of host tensors and copies device tensors back, updating the counters.

    With ``target_device="cpu"`` the "device" copy is still a separate tensor, so the whole onload/offload
    logic runs for real in tests without an accelerator.

    Args:
        device: the target device.
        stats: counters to update.
        side_streams: on CUDA, use a host->device stream for prefetches and a device->host stream for
            gradients. ``False`` queues every copy on the compute stream (serialized: copies never overlap compute).
    """

    def __init__(self, device: torch.device, stats: StatsCounter, side_streams: bool = True) -> None:
        self.device = device
        self.stats = stats
        cuda = device.type == "cuda"
        self.h2d_stream = torch.cuda.Stream(device) if cuda and side_streams else None
        self.d2h_stream = torch.cuda.Stream(device) if cuda and side_streams else None
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._closing: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # the last step's, read next step
        self._last_wait: tuple[torch.cuda.Event, tuple] | None = None  # the event, the stream (its ids)
        # The device whose current stream ``wait`` reads: this one, or the current device now (where the side
        # streams above were made too).
        self._device_index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else -1

    # ------------------------------------------------------------------ host -> device
    def to_device(
        self,
        host: torch.Tensor,
        *,
        prefetch: bool = False,
        out: torch.Tensor | None = None,
        after: torch.cuda.Event | None = None,
    ) -> PendingCopy:
        """A device copy of ``host`` with its strides (dense hosts only: see layout.py). With ``prefetch``
        (and a side stream) it is queued on the copy stream and the caller must ``wait`` before use; otherwise
        it is queued on the current stream, which the compute that uses it runs on, so no wait is needed.

        ``out``: planned device memory (a ring slot's view) to copy into instead of a new allocation;
        ``after``: the event that frees it (the copy waits for it on the device, the host never blocks).
        """
        nbytes = host.numel() * host.element_size()
        self.stats.record_h2d(nbytes)
        stream = self.h2d_stream if prefetch else None
        if stream is None:
            # On the compute stream, which recorded ``after`` itself: stream order already covers it.
            tensor = out if out is not None else self._empty_like(host)
            self._copy(tensor, host, "h2d", torch.cuda.current_stream(self.device) if self._cuda else None)
            return PendingCopy(tensor, None, planned=out is not None)
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)  # the slot's previous unit is done on the compute stream
            tensor = out if out is not None else self._empty_like(host)
            event = self._copy(tensor, host, "h2d", stream)  # its timing's end marks the copy's end too
        return PendingCopy(tensor, event, planned=out is not None)

    def _empty_like(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)

    def wait(self, pending: PendingCopy) -> torch.Tensor:
        """Make the current stream wait for ``pending`` (a GPU-side wait, not a host sync)."""
        if pending.event is not None:
            # A block's tensors share their span's copy event: the stream waits (and is timed) once for it,
            # not once per tensor (host time on the critical path when the step is launch-bound). The current
            # stream is compared by its ids: the ``Stream`` object ``torch.cuda.current_stream`` builds costs
            # a device guard and a Python object per call, host time for each of a block's dozens of tensors.
            current = torch._C._cuda_getCurrentStream(self._device_index)
            last = self._last_wait
            if last is None or last[0] is not pending.event or last[1] != current:
                stream = torch.cuda.current_stream(self.device)
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record(stream)
                stream.wait_event(pending.event)
                after.record(stream)
                self._timed.append(("wait", before, after))
                self._last_wait = (pending.event, current)
            # A copy allocated on the copy stream: tell the allocator the compute stream uses it too, so its
            # memory is not handed out again before the compute stream is done with it. Ring memory is
            # never handed back, so it needs none of this.
            if not pending.planned:
                pending.tensor.record_stream(torch.cuda.current_stream(self.device))
            pending.event = None
        return pending.tensor

    # ------------------------------------------------------------------ device -> host
    def to_host(self, device_tensor: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``device_tensor`` into ``host`` (or a new host tensor). Blocking: the caller reads it next."""
        if host is None:
            host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype)
        host.copy_(device_tensor)
        self.stats.record_d2h(device_tensor.numel() * device_tensor.element_size())
        return host

    def to_host_async(self, device_tensor: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event | None:
        """Queue a copy into pinned ``host`` on the device->host stream, after the work that produced
        ``device_tensor``. Returns the event to synchronize on before the CPU reads ``host``."""
        self.stats.record_d2h(device_tensor.numel() * device_tensor.element_size())
        if self.d2h_stream is None:
            host.copy_(device_tensor, non_blocking=self._cuda)
            if not self._cuda:
                return None
            event = torch.cuda.Event()  # the host waits on it (settle_grad) before reading ``host``
            event.record(torch.cuda.current_stream(self.device))
            return event
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            done = self._copy(host, device_tensor, "d2h", self.d2h_stream)
            device_tensor.record_stream(self.d2h_stream)
        return done

    # ------------------------------------------------------------------ timing
    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def _copy(
        self, dst: torch.Tensor, src: torch.Tensor, kind: str, stream: torch.cuda.Stream | None
    ) -> torch.cuda.Event | None:
        """Queue the copy on ``stream`` between two timing events; returns the second, recorded right after the
        copy, which is also what a waiter waits for: a separate completion event would be one more event
        created, recorded and destroyed per copy (host time per copy launch, on a step the host bounds)."""
        if stream is None:
            dst.copy_(src)
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
        self._timed.append((kind, start, end))
        return end

    def end_step(self) -> None:
        """Close the step's byte counts now and the timing of the step before it (copy seconds each way, time
        spent waiting). A step ends without a host sync, so its own timing events may still be in flight;
        one step later they are long done (waiting on them then costs nothing)."""
        finished, self._closing, self._timed = self._closing, self._timed, []
        self._last_wait = None
        seconds = {"h2d": 0.0, "d2h": 0.0, "wait": 0.0}
        for kind, start, end in finished:
            end.synchronize()
            seconds[kind] += start.elapsed_time(end) / 1e3
        self.stats.copy_wait_seconds += seconds["wait"]
        self.stats.end_step(seconds["h2d"], seconds["d2h"])
