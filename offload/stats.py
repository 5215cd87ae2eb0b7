"""What the engine did: bytes moved each way, copies made, memory held. Users tune from these."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OffloadStats:
    """A snapshot of the engine's counters (totals since the manager was created unless noted).

    Attributes:
        h2d_bytes: bytes copied host -> device.
        d2h_bytes: bytes copied device -> host (gradients, mutated buffers).
        onloads: tensor copies made to the device.
        pinned_reserved_bytes: host bytes the arena holds.
        pinned_requested_bytes: host bytes the tensors in it need.
        device_bytes: device bytes the engine holds right now (resident weights, buffers).
        peak_device_bytes: the most device bytes the engine held at once.
        steps: completed ``after_backward`` calls.
        last_step_h2d_bytes / last_step_d2h_bytes: bytes moved during the last step.
        last_step_h2d_gbps / last_step_d2h_gbps: achieved copy bandwidth (GB/s of copy time) of the step before
            the last: a step's copies are timed when the next one ends (its end needs no host sync then).
        copy_wait_seconds: total time the compute stream waited for copies.
        planned_device_bytes: the device ring for streamed weights, allocated once at setup (plan.py).
        ring_overflows: copies that found their ring slot held by another unit and took allocator memory.
        kept_resident_bytes: frozen weight bytes ``gpu_memory_budget`` holds on the device for good (a set
            budget's from step 1 on, a measured ``"auto"`` one's from step 2 on); never copied again.
        reused_bytes: frozen weight bytes not copied because their ring slot still held them (ring.py):
            the units at each end of the forward, reused by the backward or the next forward.
        activation_offloaded_bytes: checkpointed inputs copied to the host (``offload_activations``), in all.
        activation_host_bytes: the most host bytes they held at once.
        optimizer_host_bytes: host bytes of the CPU optimizer's state (``attach_optimizer``) right now: AdamW's
            moments of every host master, or of this process's part of each with ``optimizer_shard``.
        disk_weight_bytes: frozen weight bytes on the disk tier (read from their files on each use, disk.py).
        staging_bytes: the disk tier's pinned staging ring (counted in ``pinned_reserved_bytes`` too).
        disk_read_bytes / disk_read_seconds: bytes the disk tier read, and the seconds its reads took.
        disk_wait_seconds: time the training loop waited for a disk read to finish (the disk bound the step).
        optimizer_swap_bytes: the CPU optimizer's state kept in swap files (``attach_optimizer(swap_folder=)``);
            ``optimizer_host_bytes`` then counts its swap ring and the scalars kept in memory.
        optimizer_swap_read_bytes / optimizer_swap_written_bytes: state bytes read from and written to them.
        optimizer_swap_wait_seconds: time the optimizer's worker waited for a state read to finish.
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    onloads: int = 0
    pinned_reserved_bytes: int = 0
    pinned_requested_bytes: int = 0
    device_bytes: int = 0
    peak_device_bytes: int = 0
    steps: int = 0
    last_step_h2d_bytes: int = 0
    last_step_d2h_bytes: int = 0
    last_step_h2d_gbps: float = 0.0
    last_step_d2h_gbps: float = 0.0
    copy_wait_seconds: float = 0.0
    planned_device_bytes: int = 0
    ring_overflows: int = 0
    kept_resident_bytes: int = 0
    reused_bytes: int = 0
    activation_offloaded_bytes: int = 0
    activation_host_bytes: int = 0
    optimizer_host_bytes: int = 0
    disk_weight_bytes: int = 0
    staging_bytes: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_wait_seconds: float = 0.0
    optimizer_swap_bytes: int = 0
    optimizer_swap_read_bytes: int = 0
    optimizer_swap_written_bytes: int = 0
    optimizer_swap_wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """JSON-able numbers, for progress reports."""
        return asdict(self)


class StatsCounter:
    """Mutable counters the offloaders update; ``snapshot`` freezes them into an ``OffloadStats``."""

    def __init__(self) -> None:
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.onloads = 0
        self.device_bytes = 0
        self.peak_device_bytes = 0
        self.steps = 0
        self.copy_wait_seconds = 0.0
        self.planned_device_bytes = 0
        self.ring_overflows = 0
        self.kept_resident_bytes = 0
        self.reused_bytes = 0
        self._step_start = (0, 0)
        self.last_step = (0, 0)
        self.last_step_gbps = (0.0, 0.0)
        self._untimed = (0, 0)  # bytes of the step whose copy seconds come with the next end_step

    def record_h2d(self, nbytes: int) -> None:
        self.h2d_bytes += nbytes
        self.onloads += 1

    def record_d2h(self, nbytes: int) -> None:
        self.d2h_bytes += nbytes

    def hold(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def drop(self, nbytes: int) -> None:
        self.device_bytes -= nbytes

    def start_step(self) -> None:
        """Count from here (e.g. after setup moved trainable weights once)."""
        self._step_start = (self.h2d_bytes, self.d2h_bytes)

    def end_step(self, h2d_seconds: float = 0.0, d2h_seconds: float = 0.0) -> None:
        """Close a step: remember what it moved; the seconds of copy time (measured by the caller) are the
        previous step's, timed one step late."""
        h2d = self.h2d_bytes - self._step_start[0]
        d2h = self.d2h_bytes - self._step_start[1]
        self.last_step = (h2d, d2h)
        timed, self._untimed = self._untimed, (h2d, d2h)
        self.last_step_gbps = (
            timed[0] / h2d_seconds / 1e9 if h2d_seconds > 0 else 0.0,
            timed[1] / d2h_seconds / 1e9 if d2h_seconds > 0 else 0.0,
        )
        self._step_start = (self.h2d_bytes, self.d2h_bytes)
        self.steps += 1

    def snapshot(self, pinned_reserved: int, pinned_requested: int) -> OffloadStats:
        return OffloadStats(
            h2d_bytes=self.h2d_bytes,
            d2h_bytes=self.d2h_bytes,
            onloads=self.onloads,
            pinned_reserved_bytes=pinned_reserved,
            pinned_requested_bytes=pinned_requested,
            device_bytes=self.device_bytes,
            peak_device_bytes=self.peak_device_bytes,
            steps=self.steps,
            last_step_h2d_bytes=self.last_step[0],
            last_step_d2h_bytes=self.last_step[1],
            last_step_h2d_gbps=self.last_step_gbps[0],
            last_step_d2h_gbps=self.last_step_gbps[1],
            copy_wait_seconds=self.copy_wait_seconds,
            planned_device_bytes=self.planned_device_bytes,
            ring_overflows=self.ring_overflows,
            kept_resident_bytes=self.kept_resident_bytes,
            reused_bytes=self.reused_bytes,
        )
