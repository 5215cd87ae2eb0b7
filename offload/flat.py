"""Flat groups: a block's host copies laid out in one span, so one copy moves the whole block.

Used with ``granularity="block"``: a transformer layer's dozen tensors cost one large copy instead of a dozen
small ones, and the device side is one allocation carved into views. Only tensors whose host copy never
changes during training go into a span (frozen weights, buffers): a span's device copy may outlive a step
while a member is held, and a trainable host master updated by the CPU optimizer would then be stale.
"""

from __future__ import annotations

import torch

from offload.arena import PinnedArenaPool, aligned
from offload.disk import DiskSpan, DiskStage, FileRange
from offload.layout import shaped_like
from offload.offloaders import BufferOffloader, StaticParamOffloader
from offload.ring import Placement, copy_into_ring, frozen_fingerprint
from offload.transfers import CopyEngine, PendingCopy, in_backward


class FlatGroup:
    """Host copies of several tensors in one contiguous span; onload copies the span once."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        arena: PinnedArenaPool,
        copies: CopyEngine,
        *,
        name: str = "",
        disk: tuple[DiskStage, list[FileRange]] | None = None,
    ) -> None:
        self.copies = copies
        self.offsets: list[int] = []
        total = 0
        for tensor in tensors:
            self.offsets.append(total)
            total += aligned(tensor.numel() * tensor.element_size())
        # On the disk tier (disk.py) the span has no host memory: it is the shape and identity of what the
        # device slot holds, and each copy reads the members' bytes from their file into a staging slot.
        self.disk = disk
        self.staged: tuple[DiskStage, DiskSpan] | None = None
        if disk is not None:
            self.span = torch.empty((total,), dtype=torch.uint8, device="meta")
            self.staged = (disk[0], DiskSpan(name, list(zip(self.offsets, disk[1], strict=True)), total))
        else:
            self.span = arena.allocate((total,), torch.uint8)
        self.members: list[StaticParamOffloader] = []
        # The device copy of the span, held while any member is attached to a view of it. A strong
        # reference: the members' views keep the storage alive but not this Python object, so a weak one
        # died at once and every member's onload copied the whole span again (a block copied once per tensor).
        self._device_span: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._attached = 0
        self.placement: Placement | None = None  # the span's place in the device ring (offset 0 of the slot)
        self._in_ring: Placement | None = None
        # The members' views over a span copied into the ring, by the slot's address. A ring copy lands in
        # the same slot (one of prefetch + 1) every time, so the views are made once, not on every onload: on
        # a launch-bound step (a DiT block with peft's LoRA) that per-copy Python work is host time the GPU
        # waits for. Views over allocator memory (a ring overflow) are made anew and never kept.
        self._ring_views: dict[int, list[torch.Tensor | None]] = {}
        self._index: dict[int, int] = {}  # id(member) -> its position in the span
        self.frozen = True  # every member so far may be reused from its ring slot (add)

    def host_view(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """The slot for the ``index``-th tensor inside the span; on the disk tier, its view of its file."""
        if self.disk is not None:
            stage, ranges = self.disk
            view = stage.resting_view(ranges[index], tensor)
            assert view is not None, "the plan puts on disk only contiguous tensors at aligned offsets"
            return view
        return shaped_like(_view(self.span, self.offsets[index], (tensor.numel(),), tensor.dtype), tensor)

    def add(self, member: StaticParamOffloader) -> None:
        self._index[id(member)] = len(self.members)
        self.members.append(member)
        member.group = self
        # Whether a ring slot that still holds the span's copy may be reused (ring.py): frozen weights and
        # buffers, whose in-place writes show in their version counters; not a subclass that keeps more.
        # Members are added at setup only, so it is decided here rather than on every onload.
        self.frozen = self.frozen and type(member) in (StaticParamOffloader, BufferOffloader)

    def onload(self, requester: StaticParamOffloader | None, prefetch: bool) -> None:
        """Copy the span (unless a copy is still alive) and hand views to the members that need one now:
        with a new copy, the requester and any member a running forward holds or a pending backward will
        unpack; with the copy already there, the requester alone (each other member asks for itself), so a
        unit's onload, one request per member, walks the members once rather than once per member.
        ``requester=None``: every member gets its view (a whole unit's onload or prefetch)."""
        fresh = self._device_span is None
        if fresh:
            fingerprint = frozen_fingerprint(self.span, [m.tensor for m in self.members]) if self.frozen else None
            pending, self._in_ring = copy_into_ring(
                self.copies, self.span, self.placement, 0, prefetch, fingerprint, self.staged
            )
            self._device_span, self._event = pending.tensor, pending.event
        if fresh or requester is None:
            views = self._views()
            attached = 0
            for index, member in enumerate(self.members):
                if member.pending is None and (
                    requester is None or member is requester or member.holds > 0 or member.live_tokens > 0
                ):
                    attached += self._attach(index, member, views)
            self.copies.stats.hold(attached)
        elif requester.pending is None:
            self.copies.stats.hold(self._attach(self._index[id(requester)], requester, self._views()))

    # A unit whose tensors are this span's members acquires, prefetches and releases them all at once: per
    # member the same steps as its own acquire/prefetch/release (offloaders.py), in one walk instead of a
    # few method calls each. A DiT block has dozens of members, used in forward, recompute and backward, and
    # that per-member Python is host time the GPU waits for on a launch-bound step.
    def acquire_all(self) -> None:
        """Every member's ``acquire``: held, resident, and ready on the current stream."""
        for member in self.members:
            member.holds += 1
        self.onload(None, prefetch=False)
        wait = self.copies.wait
        for member in self.members:
            pending = member.pending
            assert pending is not None  # attached by onload
            if pending.event is not None:
                wait(pending)

    def prefetch_all(self) -> None:
        """Every member's ``prefetch``: the span's copy starts on the copy stream (if it is not there yet)."""
        self.onload(None, prefetch=True)

    def release_all(self, keep_if_saved: bool) -> None:
        """Every member's ``release(keep_if_saved)``."""
        keep = keep_if_saved or in_backward()
        dropped = 0
        for member in self.members:
            member.holds -= 1
            if member.holds > 0 or member.pending is None or (keep and member.live_tokens > 0):
                continue
            if type(member) is StaticParamOffloader:  # its offload(), counted once for the span; subclasses do more
                member.point_at_host()
                dropped += member.nbytes
                self._attached -= 1
            else:
                member.offload()  # calls detached()
        self.copies.stats.drop(dropped)
        if self._attached == 0 and self._device_span is not None:
            self._release_span()

    def _views(self) -> list[torch.Tensor | None] | None:
        """The kept member views over this ring copy's address (None for a copy in allocator memory)."""
        if self._in_ring is None:
            return None
        assert self._device_span is not None  # onload() made the copy
        address = self._device_span.data_ptr()
        views = self._ring_views.get(address)
        if views is None:
            if len(self._ring_views) >= 8:  # more addresses than ring slots: the plan changed; start over
                self._ring_views.clear()
            views = self._ring_views[address] = [None] * len(self.members)
        return views

    def _attach(self, index: int, member: StaticParamOffloader, views: list[torch.Tensor | None] | None) -> int:
        """Point ``member`` at its view of the span's copy; returns the bytes the caller counts as held."""
        kept = views[index] if views is not None else None
        view = kept if kept is not None else self._make_view(index, member)
        if views is not None and kept is None:
            views[index] = view
        pending = PendingCopy(view, self._event, planned=views is not None)
        self._attached += 1
        if type(member) is StaticParamOffloader:  # its attach(), counted once for the span; subclasses do more
            member.point_at_device(pending)
            return member.nbytes
        member.attach(pending)  # counts its own bytes
        return 0

    def _make_view(self, index: int, member: StaticParamOffloader) -> torch.Tensor:
        assert self._device_span is not None
        flat = _view(self._device_span, self.offsets[index], (member.host.numel(),), member.host.dtype)
        return shaped_like(flat, member.host)

    def detached(self, member: StaticParamOffloader) -> None:
        """``member`` dropped its view; with the last one gone the span's device memory is released."""
        self._attached -= 1
        if self._attached == 0:
            self._release_span()

    def _release_span(self) -> None:
        self._device_span = self._event = None
        if self._in_ring is not None:
            self._in_ring.release(self.copies.device)
            self._in_ring = None


def _view(span: torch.Tensor, offset: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return span[offset : offset + max(nbytes, 0)].view(dtype).view(shape)
