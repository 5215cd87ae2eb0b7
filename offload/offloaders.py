"""The four offloader kinds: one object per managed tensor, deciding where its data lives.

Every offloader keeps the tensor object itself stable (optimizers and autograd hold references to it) and
swaps its ``.data`` between a host copy and a device copy. Residency is reference-counted:

* ``holds``: forwards currently running that use the tensor (a unit's forward, a module called twice,
  or a permanent hold when a memory budget keeps it resident).
* ``live_tokens``: autograd saved-tensor references (see ``saved_tensors.py``) not yet released; while the
  backward pass still needs the weight these keep an onloaded copy resident.
"""

from __future__ import annotations

import threading
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
    copies: CopyEngine, host: torch.Tensor, placement: Placement | None, offset: int, prefetch: bool
) -> tuple[PendingCopy, Placement | None]:
    """Copy ``host`` to the device: into its planned ring slot when the slot is free for its unit, else into
    allocator memory (counted as a ring overflow). Returns the copy and the placement it holds, if any."""
    if placement is not None and placement.claim():
        out = placement.region(offset, host)
        pending = copies.to_device(host, prefetch=prefetch, out=out, after=placement.free_event)
        placement.hold(pending.event)
        return pending, placement
    if placement is not None:
        copies.stats.ring_overflows += 1
    return copies.to_device(host, prefetch=prefetch), None


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
        pending, self._in_ring = copy_into_ring(self.copies, self.host, self.placement, self.slot_offset, prefetch)
        self.attach(pending)

    def attach(self, pending: PendingCopy) -> None:
        """Point the tensor at a device copy (possibly still in flight)."""
        self.pending = pending
        self.tensor.data = pending.tensor
        self.copies.stats.hold(self.nbytes)

    def offload(self) -> None:
        if self.pending is None:
            return
        self.tensor.data = self.host
        self.pending = None
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


class TrainableParamOffloader(StaticParamOffloader):
    """A trainable parameter whose optimizer runs on the CPU. The host copy is the master: the optimizer
    updates it in place, so weights never travel device -> host. Gradients do: each one is copied to a host
    gradient buffer on a side stream as soon as autograd finishes accumulating it, and ``hand_over_grad``
    gives that buffer to ``param.grad`` for the optimizer. Gradient accumulation adds into the buffer."""

    kind = "trainable"

    def __init__(
        self, name: str, tensor: torch.Tensor, copies: CopyEngine, host: torch.Tensor, grad_host: torch.Tensor
    ) -> None:
        existing_grad = tensor.grad
        tensor.grad = None  # the data moves into the arena; a gradient set before is the user's, kept below
        super().__init__(name, tensor, copies, host)
        self.grad_host = grad_host
        self._grad_valid = existing_grad is not None
        # The user holds ``param.grad`` from hand-over until the next forward that uses the parameter takes
        # it back; a step that never uses the parameter leaves it exactly as the user left it.
        self._handed_over = False
        if existing_grad is not None:
            grad_host.copy_(existing_grad)
            tensor.grad = grad_host
            self._handed_over = True
        self._staging: torch.Tensor | None = None
        self._staged = False
        self._grad_event: torch.cuda.Event | None = None
        self._grad_lock = threading.Lock()  # the optimizer's worker thread settles gradients too
        self.fresh_grad = False  # a gradient arrived that no update has taken yet
        self.before_read: Callable[[TrainableParamOffloader], None] | None = None  # waits for pending updates
        self._spare_host: torch.Tensor | None = None  # delayed update: the copy the next update writes
        self._spare_grad: torch.Tensor | None = None  # delayed update: the next step's gradient buffer

    def acquire(self) -> None:
        if self.before_read is not None:
            self.before_read(self)  # before the gradient buffer or the host weights are touched
        if torch.is_grad_enabled():
            self._adopt_user_grad()
        super().acquire()

    def onload(self, prefetch: bool = False) -> None:
        if self.before_read is not None:
            self.before_read(self)  # the copy must read the updated weights, never half-written ones
        super().onload(prefetch)

    # ----------------------------------------------------------------- delayed update's second copies
    def spare(self) -> torch.Tensor:
        """The host copy the next delayed update writes while the device reads ``host``."""
        if self._spare_host is None:
            self._spare_host = torch.empty_like(self.host, pin_memory=self.host.is_pinned())
        return self._spare_host

    def publish(self, updated: torch.Tensor) -> None:
        """A delayed update finished writing ``updated`` (the spare copy): it becomes the host master."""
        self._spare_host, self.host = self.host, updated
        if self.pending is None:
            self.tensor.data = self.host

    def take_grad_for_update(self) -> torch.Tensor:
        """Hand the step's gradient buffer to a delayed update; the next step accumulates into the other."""
        if self._spare_grad is None:
            self._spare_grad = torch.empty_like(self.grad_host, pin_memory=self.grad_host.is_pinned())
        taken, self.grad_host, self._spare_grad = self.grad_host, self._spare_grad, self.grad_host
        self._grad_valid = False
        return taken

    def grad_landed(self) -> bool:
        """The gradient's device->host copy has finished (no host wait)."""
        event = self._grad_event
        return event is None or event.query()

    def _adopt_user_grad(self) -> None:
        """Before a forward that will produce gradients, take ``param.grad`` back from the user so autograd
        accumulates a fresh device gradient: a kept gradient is accumulated into, a cleared one is not."""
        grad = self.tensor.grad
        if grad is not None:
            if grad is not self.grad_host:
                self.grad_host.copy_(grad)
            self._grad_valid = True
            self.tensor.grad = None
        elif self._handed_over:
            self._grad_valid = False
        self._handed_over = False

    def offload_grad(self) -> None:
        """Post-accumulate-grad hook: the gradient is final for this backward; send it to the host."""
        grad = self.tensor.grad
        if grad is None:
            return
        self.settle_grad()  # an earlier backward's copy still to be added (accumulation without after_backward)
        if self._grad_valid:
            if self._staging is None:
                self._staging = torch.empty_like(self.grad_host, pin_memory=self.grad_host.is_pinned())
            self._grad_event = self.copies.to_host_async(grad, self._staging)
            self._staged = True
        else:
            self._grad_event = self.copies.to_host_async(grad, self.grad_host)
            self._grad_valid = True
        self.tensor.grad = None
        self.fresh_grad = True

    def settle_grad(self) -> None:
        """Wait for this gradient's copy and fold a staged one into the buffer (a host sync for this copy)."""
        with self._grad_lock:
            if self._grad_event is not None:
                self._grad_event.synchronize()
                self._grad_event = None
            if self._staged:
                assert self._staging is not None  # staged implies a staging buffer
                self.grad_host.add_(self._staging)
                self._staged = False

    def hand_over_grad(self) -> None:
        """After backward: the accumulated host gradient becomes ``param.grad`` for the optimizer.

        A parameter no forward used since the last hand-over keeps whatever ``param.grad`` the user left
        (``None`` after ``zero_grad()``): it gets no gradient, stale or zero, as without offload."""
        self.settle_grad()
        if self._handed_over:
            return
        if self._grad_valid and self.pending is None:
            self.tensor.grad = self.grad_host
            self._handed_over = True

    def detach(self) -> None:
        self.settle_grad()
        if self._handed_over:  # the user's gradient (None after zero_grad), out of the arena
            grad = self.tensor.grad
            grad = grad.clone() if grad is self.grad_host else grad
        else:  # a gradient still accumulating (between micro-batches)
            grad = self.grad_host.clone() if self._grad_valid else None
        self.tensor.grad = None
        super().detach()
        self.tensor.grad = grad


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
