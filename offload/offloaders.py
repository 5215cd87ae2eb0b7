"""The offloader kinds: one object per managed tensor, deciding where its data lives (the trainable one, with
the CPU optimizer's gradients, is in trainable.py).

Every offloader keeps the tensor object itself stable (optimizers and autograd hold references to it) and
swaps its ``.data`` between a host copy and a device copy. Residency is reference-counted:

* ``holds``: forwards currently running that use the tensor (a unit's forward, a module called twice,
  or a permanent hold when a memory budget keeps it resident).
* ``live_tokens``: autograd saved-tensor references (see ``saved_tensors.py``) not yet released; while the
  backward pass still needs the weight these keep an onloaded copy resident.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from offload.transfers import CopyEngine, PendingCopy, in_backward

if TYPE_CHECKING:
    from offload.flat import FlatGroup
    from offload.ring import Placement


class TensorOffloader:
    """Residency bookkeeping shared by every kind; subclasses say how to onload and offload."""

    kind = "tensor"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine) -> None:
        self.name = name
        self.tensor = tensor
        self.copies = copies
        self.nbytes = tensor.numel() * tensor.element_size()
        self.holds = 0
        self.live_tokens = 0
        self.pending: PendingCopy | None = None
        self.group: FlatGroup | None = None
        self.on_backward_use: Callable[[TensorOffloader], None] | None = None
        # Where the device copy lands: a slot of the device ring at ``slot_offset`` (plan.py), or None for
        # memory from the allocator (no ring, or a unit kept resident for good by the memory budget).
        self.placement: Placement | None = None
        self.slot_offset = 0
        self._in_ring: Placement | None = None

    @property
    def resident(self) -> bool:
        return self.pending is not None

    @property
    def resident_nbytes(self) -> int:
        """Device bytes the tensor takes while a memory budget keeps it outside the ring: what it streams as,
        for every kind but an NF4 weight kept in its dequantized form (dequantize_on_arrival.py)."""
        return self.nbytes

    @property
    def device_copy(self) -> torch.Tensor | None:
        return self.pending.tensor if self.pending is not None else None

    def acquire(self) -> None:
        """A forward that uses the tensor starts: make it resident and ready on the compute stream."""
        self.holds += 1
        self.ensure_resident()

    def release(self, keep_if_saved: bool = False) -> None:
        """A forward that used the tensor ended. The weight stays while saved references still need it when
        the backward is running (a checkpoint recompute) or about to run (``keep_if_saved``: the last unit of
        forward is the first of backward), so it is not copied again."""
        self.holds -= 1
        if self.holds == 0 and not ((keep_if_saved or in_backward()) and self.live_tokens > 0):
            self.offload()

    def token_packed(self) -> None:
        self.live_tokens += 1

    def token_released(self) -> None:
        self.live_tokens -= 1
        if self.live_tokens == 0 and self.holds == 0:
            self.offload()

    def ensure_resident(self) -> torch.Tensor:
        """The device copy, onloading it first if needed, with the current stream waiting for it."""
        if self.pending is None:
            self.onload()
        assert self.pending is not None  # onload() set it
        return self.copies.wait(self.pending)

    def prefetch(self) -> None:
        """Start the copy on the copy stream now; whoever uses it later waits on its event."""
        if self.pending is None:
            self.onload(prefetch=True)

    def onload(self, prefetch: bool = False) -> None:
        raise NotImplementedError

    def offload(self) -> None:
        raise NotImplementedError

    def detach(self) -> None:
        """Leave the tensor as an ordinary CPU tensor holding its current value."""
        raise NotImplementedError

    def leave_ring(self) -> None:
        """From now on copy into memory of its own (a unit the budget keeps resident for good must not hold
        a ring slot that the other units of its class take turns in)."""
        self.offload()
        self.placement = None
        if self.group is not None:
            self.group.placement = None

    def __repr__(self) -> str:
        where = self.device_copy.device if self.device_copy is not None else "cpu"
        return f"{type(self).__name__}({self.name!r}, {self.nbytes} bytes, on {where})"


def copy_into_ring(
    copies: CopyEngine,
    host: torch.Tensor,
    placement: Placement | None,
    offset: int,
    prefetch: bool,
    fingerprint: tuple[int, ...] | None = None,
) -> tuple[PendingCopy, Placement | None]:
    """Copy ``host`` to the device: into its planned ring slot when the slot is free for its unit, else into
    allocator memory (counted as a ring overflow). Returns the copy and the placement it holds, if any.

    ``fingerprint``: for a frozen tensor, the version counters that change when it is written in place
    (``frozen_fingerprint``). If the slot still holds this copy with that fingerprint, it is not made again
    (ring.py); ``None`` (a tensor that changes between steps, or one whose slot keeps derived data): always copy.
    """
    if placement is not None and placement.claim():
        out = placement.region(offset, host)
        if fingerprint is not None and placement.still_holds(offset, host, fingerprint):
            # No copy: the compute stream already waited for the one that wrote these bytes (when it used
            # them, or when the slot was released); a later copy into the slot that may still run ahead of
            # this use (the unit's other tensors) is waited for through the slot's last write.
            pending = PendingCopy(out, placement.slot.write_event, planned=True)
            copies.stats.reused_bytes += host.numel() * host.element_size()
        else:
            pending = copies.to_device(host, prefetch=prefetch, out=out, after=placement.free_event)
            placement.copied(offset, host, fingerprint)
        placement.hold(pending.event)
        return pending, placement
    if placement is not None:
        copies.stats.ring_overflows += 1
    return copies.to_device(host, prefetch=prefetch), None


def frozen_fingerprint(host: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of a frozen host copy and the parameters or buffers over it. An in-place write
    through either (``load_state_dict``, ``param.mul_()`` under ``no_grad``, a buffer copied back) changes one
    of them; the engine's own ``.data`` swaps do not. A write through ``.data`` is invisible to it, as it is
    to autograd."""
    return (host._version, *(t._version for t in tensors))


class StaticParamOffloader(TensorOffloader):
    """A frozen parameter: one permanent host copy; onload copies it in, offload just drops the device copy
    (the host copy is never stale, so nothing goes back over the link)."""

    kind = "static"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine, host: torch.Tensor) -> None:
        super().__init__(name, tensor, copies)
        if tensor.data.data_ptr() != host.data_ptr():  # else it was filled in place (loaded from meta)
            host.copy_(tensor.data)
        self.host = host
        tensor.data = host

    def onload(self, prefetch: bool = False) -> None:
        if self.group is not None:
            self.group.onload(self, prefetch)  # one copy for the whole block; it calls attach()
            return
        fingerprint = frozen_fingerprint(self.host, [self.tensor]) if self.kind in ("static", "buffer") else None
        pending, self._in_ring = copy_into_ring(
            self.copies, self.host, self.placement, self.slot_offset, prefetch, fingerprint
        )
        self.attach(pending)

    def attach(self, pending: PendingCopy) -> None:
        """Point the tensor at a device copy (possibly still in flight)."""
        self.point_at_device(pending)
        self.copies.stats.hold(self.nbytes)

    def point_at_device(self, pending: PendingCopy) -> None:
        """``attach`` without counting the bytes: a flat group attaching a whole span counts them once."""
        self.pending = pending
        self.tensor.data = pending.tensor

    def point_at_host(self) -> None:
        """The tensor reads its host copy again and drops the device one (no counting, no release): the part
        of ``offload`` that a flat group releasing a whole span does per member."""
        self.tensor.data = self.host
        self.pending = None

    def offload(self) -> None:
        if self.pending is None:
            return
        self.point_at_host()
        self.copies.stats.drop(self.nbytes)
        if self.group is not None:
            self.group.detached(self)
        elif self._in_ring is not None:
            self._in_ring.release(self.copies.device)
            self._in_ring = None

    def detach(self) -> None:
        self.offload()
        self.tensor.data = self.host.clone()


class BufferOffloader(StaticParamOffloader):
    """A module buffer (BatchNorm running statistics). Like a frozen weight, but a forward may update it in
    place on the device; then the new value is copied back to the host copy before the device copy is
    dropped (the reference rebinds to the stale host copy and loses it)."""

    kind = "buffer"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine, host: torch.Tensor) -> None:
        super().__init__(name, tensor, copies, host)
        # Normalization kernels update running statistics without bumping the version counter; for those
        # buffers the owner's training flag says whether a forward may have changed them.
        self.updated_by: torch.nn.Module | None = None

    def attach(self, pending: PendingCopy) -> None:
        super().attach(pending)
        self._version_at_onload = self.tensor._version

    def offload(self) -> None:
        if self.pending is None:
            return
        changed = self.tensor._version != self._version_at_onload
        if changed or (self.updated_by is not None and self.updated_by.training):
            self.copies.to_host(self.pending.tensor, self.host)
        super().offload()


class AlwaysOnGPUParamOffloader(TensorOffloader):
    """A trainable parameter whose optimizer runs on the device (LoRA adapters): moved once, never streamed."""

    kind = "always_on_device"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine) -> None:
        super().__init__(name, tensor, copies)
        self.pending = copies.to_device(tensor.data)
        copies.stats.hold(self.nbytes)
        tensor.data = self.pending.tensor
        if tensor.grad is not None:
            tensor.grad = tensor.grad.to(copies.device)

    def acquire(self) -> None:
        pass

    def release(self, keep_if_saved: bool = False) -> None:
        pass

    def token_packed(self) -> None:
        pass

    def token_released(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def onload(self, prefetch: bool = False) -> None:
        pass

    def offload(self) -> None:
        pass

    def detach(self) -> None:
        self.tensor.data = self.tensor.data.to("cpu")
        if self.tensor.grad is not None:
            self.tensor.grad = self.tensor.grad.to("cpu")
        self.copies.stats.drop(self.nbytes)
        self.pending = None
