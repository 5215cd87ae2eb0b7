"""The offloader of a trainable parameter whose optimizer runs on the CPU (optimizer offload): the host copy
is the master the optimizer updates; gradients travel device -> host as backward produces them."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from offload.offloaders import StaticParamOffloader
from offload.shards import ParamPart
from offload.transfers import CopyEngine


class TrainableParamOffloader(StaticParamOffloader):
    """A trainable parameter whose optimizer runs on the CPU. The host copy is the master: the optimizer
    updates it in place, so weights never travel device -> host. Gradients do: each one is copied to a host
    gradient buffer on a side stream as soon as autograd finishes accumulating it, and ``hand_over_grad``
    gives that buffer to ``param.grad`` for the optimizer. Gradient accumulation adds into the buffer.

    With a ``part`` (``optimizer_shard``, shards.py) the buffer holds that part of the flat gradient only and
    is never ``param.grad`` (which has the weight's shape): the CPU optimizer (``attach_optimizer``) reads it
    directly, and the gradient is spent when the optimizer's ``zero_grad`` runs (`release_grad`)."""

    kind = "trainable"

    def __init__(
        self,
        name: str,
        tensor: torch.Tensor,
        copies: CopyEngine,
        host: torch.Tensor,
        grad_host: torch.Tensor,
        part: ParamPart | None = None,
    ) -> None:
        existing_grad = tensor.grad
        tensor.grad = None  # the data moves into the arena; a gradient set before is the user's, kept below
        super().__init__(name, tensor, copies, host)
        self.grad_host = grad_host
        self.part = part
        self._grad_valid = existing_grad is not None
        # The user holds ``param.grad`` from hand-over until the next forward that uses the parameter takes
        # it back; a step that never uses the parameter leaves it exactly as the user left it.
        self._handed_over = False
        if existing_grad is not None:
            grad_host.copy_(self.own(existing_grad))
            if part is None:
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
        # Delayed update: the host tensor the next device read is copied back into, and whom to tell.
        self._snapshot_request: tuple[torch.Tensor, Callable[[torch.cuda.Event | None], None]] | None = None
        self._snapshot_event: torch.cuda.Event | None = None  # that copy, which the ring slot's reuse waits for

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """What this process's optimizer steps of a weight-shaped ``tensor``: all of it, or its ``part``."""
        return tensor if self.part is None else self.part.of(tensor)

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

    def ensure_resident(self) -> torch.Tensor:
        device_copy = super().ensure_resident()
        if self._snapshot_request is not None:
            into, then = self._snapshot_request
            self._snapshot_request = None
            self._snapshot_event = self.copies.to_host_async(device_copy, into)
            then(self._snapshot_event)
        return device_copy

    def offload(self) -> None:
        d2h = self.copies.d2h_stream
        if self.pending is None or self._snapshot_event is None or d2h is None:
            super().offload()
            return
        # The copy back may still be reading the ring slot: the slot is free again after it, and after the
        # compute queued so far (the release records its event on the device->host stream; compute goes on).
        d2h.wait_stream(torch.cuda.current_stream(self.copies.device))
        with torch.cuda.stream(d2h):
            super().offload()
        self._snapshot_event = None

    # ----------------------------------------------------------------- delayed update's second copies
    def snapshot_next_read(self, into: torch.Tensor, then: Callable[[torch.cuda.Event | None], None]) -> None:
        """Copy the device copy that the next read makes back into host tensor ``into`` (device->host
        stream), then call ``then`` with that copy's event. A delayed update starts from the published weights
        in the spare copy; this way the copy engine fills it, and the CPU's time and memory bandwidth are
        left to the optimizer."""
        self._snapshot_request = (into, then)

    def cancel_snapshot(self) -> None:
        """No device read came (a checkpoint, or the prefetch was not used): the CPU makes that copy."""
        self._snapshot_request = None

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
                self.grad_host.copy_(self.own(grad))
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
        grad = self.own(grad)  # with a part, only it crosses the link (the caller averaged it across the ranks)
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
        (``None`` after ``zero_grad()``): it gets no gradient, stale or zero, as without offload. With a
        ``part`` the buffer stays the engine's: the optimizer reads it there."""
        self.settle_grad()
        if self._handed_over or self.part is not None:
            return
        if self._grad_valid and self.pending is None:
            self.tensor.grad = self.grad_host
            self._handed_over = True

    def release_grad(self) -> None:
        """The optimizer's ``zero_grad``: ``param.grad`` goes; a part's buffer is spent (the next backward writes
        it afresh; a buffer handed over as ``param.grad`` learns that at the next forward instead)."""
        self.tensor.grad = None
        if self.part is not None:
            self._grad_valid = False

    def detach(self, copy: bool = True) -> None:
        self.settle_grad()
        if self.part is not None:  # only a part of the gradient was ever here: none is left on the tensor
            grad = None
        elif self._handed_over:  # the user's gradient (None after zero_grad), out of the arena
            grad = self.tensor.grad
            grad = grad.clone() if grad is self.grad_host else grad
        else:  # a gradient still accumulating (between micro-batches)
            grad = self.grad_host.clone() if self._grad_valid else None
        self.tensor.grad = None
        super().detach(copy)
        self.tensor.grad = grad
