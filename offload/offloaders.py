"""The offloader kinds: one object per managed tensor, deciding where its data lives (the trainable one, with
the CPU optimizer's gradients, is in trainable.py).

Every offloader keeps the tensor object itself stable (optimizers and autograd hold references to it) and
swaps its ``.data`` between a host copy and a device copy (the lifecycle: ``TensorOffloader``). Residency
is reference-counted:

* ``holds``: forwards currently running that use the tensor (a unit's forward, a module called twice,
  or a permanent hold when a memory budget keeps it resident).
* ``live_tokens``: autograd saved-tensor references (see ``saved_tensors.py``) not yet released; while the
  backward pass still needs the weight these keep an onloaded copy resident.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from offload.ring import Placement, copy_into_ring, frozen_fingerprint
from offload.transfers import CopyEngine, PendingCopy, in_backward

if TYPE_CHECKING:
    from offload.flat import FlatGroup


class TensorOffloader:
    """Residency bookkeeping shared by every kind; subclasses say how to onload and offload.

    The lifecycle of an offloader, stage by stage: the method that implements each stage here (or in the
    subclass named), and who calls it. The manager's hooks drive every stage; each hook's ``RemovableHandle``
    is kept so that detaching undoes attaching.

    1. Attach (manager.py, ``OffloadTrainingManager.__init__``): ``_make_unit`` builds one offloader per
       tensor (``_offloader_for`` picks the kind) and gives it its ``placement`` and ``slot_offset`` in the
       device ring from the memory plan, its ``group`` (``FlatGroup.add``, flat.py) or NF4 ``batch``
       (``ArrivalBatch``, quant/dequantize_on_arrival.py), and ``on_backward_use``. ``_attach`` then registers
       a forward pre-hook and a forward hook on each unit's modules and, for a trainable host master, a
       post-accumulate-grad hook; ``SavedTensorRouter`` (saved_tensors.py) is pushed around each unit's forward.
    2. Allocate the host copy (the subclass's ``__init__``, called by the manager with memory from
       ``PinnedArenaPool.allocate``, arena.py, or a span's ``FlatGroup.host_view``): the tensor's value is
       copied into it (or ``initialize`` fills it, ``_materialize``) and ``tensor.data`` then *is* the host
       copy (``torch.utils.swap_tensors`` for a quantized weight). ``AlwaysOnGPUParamOffloader`` instead moves
       its tensor to the device once, here, and is a no-op in every later stage until detach.
    3. Onload before forward (``OffloadTrainingManager._onload_before_forward`` -> ``OffloadUnit.onload``,
       units.py): ``acquire`` takes a hold and ``ensure_resident`` calls ``onload``, which copies the host copy
       into its ring slot (``copy_into_ring``, ring.py, through ``CopyEngine.to_device``, transfers.py) and
       points the tensor at it (``attach``); the compute stream waits for the copy (``CopyEngine.wait``).
       Ahead of it, ``PrefetchSchedule.forward_onloaded`` (schedule.py) calls ``prefetch`` on the next units'
       offloaders, which queues their ``onload`` on the copy stream.
    4. Offload after forward (``OffloadTrainingManager._offload_after_forward`` -> ``OffloadUnit.offload``):
       ``release`` drops the hold, and with the last one ``offload`` points the tensor back at its host copy
       and frees the slot (``Placement.release``, ring.py), unless autograd's saved references still need the
       weight soon (``keep_if_saved``). Meanwhile the router's ``pack`` has saved a token instead of the device
       copy (``SavedWeight``, which calls ``token_packed``).
    5. Onload before backward (``SavedWeight.unpack``, saved_tensors.py, when a backward node needs the
       weight): ``ensure_resident`` onloads it again if it was dropped, and ``on_backward_use``
       (``PrefetchSchedule.weight_unpacked``) prefetches what the backward needs next. A checkpoint recompute
       goes through stages 3 and 4 again, inside the backward.
    6. Offload after backward (``SavedWeight.__del__``, when autograd frees the node's saved tensors):
       ``token_released``, and with the last token and no hold, ``offload``. A trainable master's gradient goes
       to the host as it is accumulated (``OffloadTrainingManager._offload_grad_after_backward`` ->
       ``TrainableParamOffloader.offload_grad``, trainable.py). ``OffloadTrainingManager.after_backward``
       offloads whatever is still resident and gives host gradients to ``param.grad`` (``hand_over_grad``).
    7. Optimizer step (the user's ``optimizer.step()``; with ``attach_optimizer``, ``StepDuringBackward``,
       optimizer_step.py, per parameter on a worker thread as each gradient lands): only a trainable host
       master changes, in place on the host; ``TrainableParamOffloader.acquire`` and ``onload`` call
       ``before_read`` first, so no copy reads a half-updated weight. Frozen kinds never change. Between steps
       the memory budget (``PrefetchSchedule.apply_budget``) may call ``leave_ring`` and ``acquire`` once to
       keep a unit resident for good.
    8. Detach (``OffloadTrainingManager.remove``): every hook handle is removed, then ``detach`` leaves the
       tensor an ordinary CPU tensor holding its current value, out of the arena (a trainable one with its
       gradient), as it was before attaching.
    """

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

    def detach(self, copy: bool = True) -> None:
        """Leave the tensor as an ordinary CPU tensor holding its current value: in memory of its own, or
        (``copy=False``) as a view of its host copy, which then lives as long as the tensor does."""
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
        # A weight on the disk tier (disk.py): its host is a view of its file's map, and ``detach`` reads the
        # bytes into memory of the tensor's own with this.
        self.restore: Callable[[], torch.Tensor] | None = None

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

    def detach(self, copy: bool = True) -> None:
        self.offload()  # the tensor reads its host copy
        if copy:
            self.tensor.data = self.restore() if self.restore is not None else self.host.clone()


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

    def detach(self, copy: bool = True) -> None:
        self.tensor.data = self.tensor.data.to("cpu")
        if self.tensor.grad is not None:
            self.tensor.grad = self.tensor.grad.to("cpu")
        self.copies.stats.drop(self.nbytes)
        self.pending = None
