"""Engine options: a plain dataclass, so `offload/` needs nothing beyond torch."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
AUTO_BUDGET = "auto"  # gpu_memory_budget measured by the engine (auto_budget.py)


def parse_bytes(value: int | str | None, *, name: str = "gpu_memory_budget") -> int | None:
    """Turn ``8GiB``, ``"512 MB"`` or ``1073741824`` into a byte count; ``None`` stays ``None``.

    Raises:
        ValueError: naming ``name`` when the value is negative or not a size.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a size like '8GiB'; got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes; got {value}")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} must be a byte count or a size like '8GiB' or '512MB'; got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    """A size for messages: ``1.50 GiB``, ``12.0 MiB``, ``3.4 KiB``, ``512 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if scale == 2**30 else f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass(kw_only=True)
class OffloadOptions:
    """How the engine streams weights. The defaults suit most models; see docs for tuning.

    Attributes:
        prefetch: how many units ahead to copy while the current one computes. ``0`` copies each unit
            on demand on the compute stream (serialized: copies never overlap compute).
        granularity: ``"leaf"`` makes every leaf module with weights a unit (the default);
            ``"block"`` groups each repeated block (e.g. a transformer layer) into one unit and one copy.
        gpu_memory_budget: device bytes the engine may keep resident (``int`` or ``"8GiB"``). Units that
            fit stay on the device and are never copied again (small ones first, then large ones spread
            evenly over the step, so the copies of the rest overlap their compute); ``None`` streams everything.
            ``"auto"``: the engine measures it after the second step, as what ``gpu_memory_limit`` (or the
            device's free memory) leaves above the peak those steps reserved, less a margin (auto_budget.py).
        gpu_memory_limit: device bytes this process may use in all (``int`` or ``"24GiB"``), enforced through
            the CUDA caching allocator, so training behaves as on a smaller card or leaves room for other
            processes on a shared one. The engine checks its device memory plan against it at setup.
            ``None``: the whole device.
        pin_memory: keep host copies in page-locked memory (fast, asynchronous copies). Falls back to
            ordinary memory when no accelerator exists.
        dequantize_on_arrival: a streamed NF4 weight is dequantized once per visit, on the copy stream, into
            room beside its payload in the device ring, and computed with as a plain tensor
            (dequantize_on_arrival.py); ``False`` leaves the dequantization to torchao inside every call.
        reuse_ring_slots: a frozen weight whose ring slot still holds its bytes from its last visit (the
            step's two turnarounds) is not copied again (ring.py); ``False`` copies on every visit, for
            comparison, or for code that writes frozen weights through ``.data``, which no version counter sees.
        offload_activations: keep what gradient checkpointing saves (each block's input) in pinned host memory
            from forward to the block's recompute (activations.py; ``manager.activations.wrap`` the
            checkpoint function), so the sequence length is bound by host memory rather than the device.
        activation_host_bytes: the host buffers one step's checkpointed inputs take, in the order they are
            saved (a job plans them from its sequence length); the memory plan sizes their arena from them,
            which grows if a step saves more. Empty: allocated as they come.
        whole_units: dotted module names each streamed as one unit in one copy, whatever ``granularity`` and
            the split threshold (a frozen vision tower that runs once a step); empty: none.
        host_memory_limit: pinned host bytes the engine may hold (``int`` or ``"16GiB"``): its arena (frozen
            weights kept in RAM, buffers, trainable masters and their gradients), the disk tier's staging ring
            and the checkpointed inputs' arena. Where the frozen weights would exceed it, units whose weights
            the manager's ``disk`` locator finds in their checkpoint files are read from there on each use
            instead (disk.py): small units and ones spread over the step stay in RAM, the rest go to disk.
            ``None``: every frozen weight in RAM.
        disk_read_ahead: units the disk tier reads ahead of the one being copied (its staging ring holds one
            more slot than this, each the size of the largest disk unit).
        disk_io: how the disk tier reads its files (direct_io.py): ``"direct"`` with ``O_DIRECT``, past the page
            cache, whose copies would count against the host's memory and push out other jobs' pages (a
            filesystem that refuses it fails the manager's construction); ``"buffered"`` through the page cache;
            ``"auto"`` direct where the filesystem allows, else buffered (the stage's ``fallback`` says why).
    """

    prefetch: int = 1
    granularity: str = "leaf"
    gpu_memory_budget: int | str | None = None
    gpu_memory_limit: int | str | None = None
    pin_memory: bool = True
    dequantize_on_arrival: bool = True
    reuse_ring_slots: bool = True
    offload_activations: bool = False
    activation_host_bytes: tuple[int, ...] = ()
    whole_units: tuple[str, ...] = ()
    host_memory_limit: int | str | None = None
    disk_read_ahead: int = 2
    disk_io: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (0 = no prefetch); got {self.prefetch!r}")
        if self.granularity not in ("leaf", "block"):
            raise ValueError(f"granularity must be 'leaf' or 'block'; got {self.granularity!r}")
        if self.gpu_memory_budget != AUTO_BUDGET:
            try:
                self.gpu_memory_budget = parse_bytes(self.gpu_memory_budget)
            except ValueError:
                if not isinstance(self.gpu_memory_budget, str):  # a negative count or a bool: its own message
                    raise
                raise ValueError(
                    "gpu_memory_budget must be a byte count, a size like '8GiB' or '512MB', or 'auto' (measured "
                    f"after the second step); got {self.gpu_memory_budget!r}"
                ) from None
        self.gpu_memory_limit = parse_bytes(self.gpu_memory_limit, name="gpu_memory_limit")
        if self.gpu_memory_limit == 0:
            raise ValueError("gpu_memory_limit must be a positive size such as '24GiB' (or None for the whole device)")
        self.host_memory_limit = parse_bytes(self.host_memory_limit, name="host_memory_limit")
        if self.host_memory_limit == 0:
            raise ValueError("host_memory_limit must be a positive size such as '16GiB' (or None for no limit)")
        if not isinstance(self.disk_read_ahead, int) or self.disk_read_ahead < 0:
            raise ValueError(f"disk_read_ahead must be an integer >= 0; got {self.disk_read_ahead!r}")
        if self.disk_io not in ("auto", "direct", "buffered"):
            raise ValueError(f"disk_io must be 'auto', 'direct' or 'buffered'; got {self.disk_io!r}")
        budget = self.gpu_memory_budget
        if self.gpu_memory_limit and isinstance(budget, int) and budget and budget >= self.gpu_memory_limit:
            raise ValueError(
                f"gpu_memory_budget ({self.gpu_memory_budget} bytes) must be below gpu_memory_limit "
                f"({self.gpu_memory_limit} bytes): the budget's resident weights are part of the limit"
            )
