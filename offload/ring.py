"""The device ring: the planned memory that streamed weights land in (see plan.py for how it is sized).

One device allocation, made at setup. A unit's copy writes into its slot and compute reads its weights there;
when the unit is offloaded the slot is free again. Reuse is ordered on the device, never by the host: the
copy into a slot waits (on the copy stream) for the event recorded when its previous unit was released on
the compute stream. If a slot is still held by another unit when a copy wants it (a schedule the plan did
not foresee: a module called out of order, a hold the user keeps), that copy takes ordinary device memory
instead and is counted in ``stats().ring_overflows``: correct, only not planned.

A slot also remembers what its unit last copied into it. A frozen weight's copy that finds its slot still
holding exactly those bytes (no other unit wrote the slot since, and neither the host copy nor the parameter
was written in place: their version counters are unchanged) is not made again. That is the case at both
turnarounds of a step: the backward ends with the units the next forward starts with, and the forward ends
with the units the backward starts with, so the last units through each slot are reused
(``stats().reused_bytes``). Every offloader copies into its slot through ``copy_into_ring``, which makes that
choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from offload.transfers import CopyEngine, PendingCopy

if TYPE_CHECKING:
    from offload.disk import DiskSpan, DiskStage

SLOT_ALIGNMENT = 512  # slot starts: generous for vectorized kernels reading the weights in place


def slot_stride(slot_bytes: int) -> int:
    """The bytes one slot of ``slot_bytes`` takes in the ring's buffer: rounded up to ``SLOT_ALIGNMENT``."""
    return (slot_bytes + SLOT_ALIGNMENT - 1) // SLOT_ALIGNMENT * SLOT_ALIGNMENT


@dataclass(frozen=True)
class RingClass:
    """Slots for units of one layout: ``depth`` slots of ``slot_bytes`` at ``offset`` in the ring buffer, each
    with a room of ``room_bytes`` at ``room_offset`` in the room buffer (dequantized weights; usually 0)."""

    slot_bytes: int
    depth: int
    members: int
    offset: int
    room_bytes: int = 0
    room_offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.depth * slot_stride(self.slot_bytes)

    @property
    def room_nbytes(self) -> int:
        return self.depth * slot_stride(self.room_bytes) if self.room_bytes else 0


class RingSlot:
    """One slot: a device byte range, the unit holding it, and the events that order its reuse."""

    __slots__ = (
        "buffer",
        "contents",
        "contents_of",
        "free_event",
        "owner",
        "placements",
        "remembers",
        "room",
        "users",
        "write_event",
    )

    def __init__(self, buffer: torch.Tensor, room: torch.Tensor, remembers: bool = True) -> None:
        self.buffer = buffer
        self.room = room  # where the slot's weights dequantized on arrival are written (plan.py)
        self.owner: object | None = None
        self.placements = 0  # units placed in this slot at attach: 1 for a unit in a class of its own
        self.users = 0
        self.free_event: torch.cuda.Event | None = None  # recorded when the last user let go
        self.write_event: torch.cuda.Event | None = None  # the last copy into the slot
        # What ``contents_of`` (the placement that claimed the slot last) copied into it: offset -> (the host
        # tensor copied, its fingerprint then). Cleared when another placement claims the slot.
        self.contents: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}
        self.contents_of: Placement | None = None
        self.remembers = remembers  # False: OffloadOptions(reuse_ring_slots=False), every visit copies


class Placement:
    """A unit's claim on its slot: its tensors' device copies are views at fixed offsets inside it."""

    __slots__ = ("slot",)

    def __init__(self, slot: RingSlot) -> None:
        self.slot = slot

    @property
    def alone(self) -> bool:
        """Whether no other unit takes turns in this slot (a unit in a ring class of its own)."""
        return self.slot.placements == 1

    def claim(self) -> bool:
        """Take the slot for this unit; False while another unit still holds it."""
        slot = self.slot
        if slot.owner is None or slot.owner is self:
            slot.owner = self
            if slot.contents_of is not self:  # another unit wrote here since: nothing in it is this unit's
                slot.contents.clear()
                slot.contents_of = self
            return True
        return False

    def still_holds(self, offset: int, host: torch.Tensor, fingerprint: tuple[int, ...]) -> bool:
        """Whether the claimed slot still holds this unit's copy of ``host`` at ``offset``, as ``fingerprint``
        (version counters) says it was when copied."""
        held = self.slot.contents.get(offset)
        return held is not None and held[0] is host and held[1] == fingerprint

    def copied(self, offset: int, host: torch.Tensor, fingerprint: tuple[int, ...] | None) -> None:
        """A copy of ``host`` into the claimed slot at ``offset`` was queued (``None``: not reusable)."""
        if fingerprint is None or not self.slot.remembers:
            self.slot.contents.pop(offset, None)
        else:
            self.slot.contents[offset] = (host, fingerprint)

    def region(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A device view at ``offset`` with the shape, dtype and (dense) strides of host tensor ``like``."""
        nbytes = like.numel() * like.element_size()
        return self.slot.buffer[offset : offset + nbytes].view(like.dtype).as_strided(like.shape, like.stride())

    def room_region(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A view at ``offset`` in the slot's room, shaped like ``like`` (contiguous)."""
        nbytes = like.numel() * like.element_size()
        return self.slot.room[offset : offset + nbytes].view(like.dtype).view(like.shape)

    @property
    def free_event(self) -> torch.cuda.Event | None:
        return self.slot.free_event

    def hold(self, write_event: torch.cuda.Event | None) -> None:
        """A copy into the slot was queued (``write_event`` marks its end on the copy stream)."""
        self.slot.users += 1
        if write_event is not None:
            self.slot.write_event = write_event

    def wrote(self, event: torch.cuda.Event) -> None:
        """More work writing into or reading the slot was queued after the copy (it ends at ``event``)."""
        self.slot.write_event = event

    def release(self, device: torch.device) -> None:
        """One user let go; with the last one the slot is free after the compute queued so far."""
        slot = self.slot
        slot.users -= 1
        if slot.users > 0:
            return
        slot.owner = None
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            if slot.write_event is not None:
                # A prefetched copy nobody waited for: the next copy must not overtake it.
                stream.wait_event(slot.write_event)
                slot.write_event = None
            slot.free_event = torch.cuda.Event()
            slot.free_event.record(stream)


class DeviceRing:
    """The ring's one allocation and its slots, built from the memory plan's ring classes
    (``MemoryPlan.ring_classes``, plan.py), which it lays out exactly as the plan sized them."""

    def __init__(self, classes: Sequence[RingClass], device: torch.device, reuse: bool = True) -> None:
        room_bytes = sum(klass.room_nbytes for klass in classes)
        self.nbytes = sum(klass.nbytes for klass in classes) + room_bytes  # the plan's ``ring_bytes``
        self.buffer = torch.empty(max(self.nbytes - room_bytes, 1), dtype=torch.uint8, device=device)
        # A separate allocation: a dequantization reads the slot's payload while it writes the room.
        self.rooms = torch.empty(max(room_bytes, 1), dtype=torch.uint8, device=device)
        self.slots: list[list[RingSlot]] = []
        for klass in classes:
            stride, room_stride = slot_stride(klass.slot_bytes), slot_stride(klass.room_bytes)
            self.slots.append(
                [
                    RingSlot(
                        self.buffer[klass.offset + i * stride : klass.offset + i * stride + klass.slot_bytes],
                        self.rooms[klass.room_offset + i * room_stride :][: klass.room_bytes],
                        remembers=reuse,
                    )
                    for i in range(klass.depth)
                ]
            )

    def placement(self, ring_class: int | None, slot: int) -> Placement | None:
        """The placement of a unit of ``ring_class`` in ``slot`` (None for a unit that streams nothing)."""
        if ring_class is None:
            return None
        self.slots[ring_class][slot].placements += 1
        return Placement(self.slots[ring_class][slot])

    def reassign(self, placements: list[tuple[int, Placement]]) -> None:
        """Give ``placements`` (ring class, placement; units in the order they run) their class's slots
        round-robin. Between steps: a placement whose unit holds its slot keeps it."""
        turns = [0] * len(self.slots)
        for klass, placement in placements:
            if placement.slot.owner is placement:
                continue
            slots = self.slots[klass]
            placement.slot = slots[turns[klass] % len(slots)]
            turns[klass] += 1

    def __repr__(self) -> str:
        return f"DeviceRing({self.nbytes} bytes, classes={[len(s) for s in self.slots]})"


def copy_into_ring(
    copies: CopyEngine,
    host: torch.Tensor,
    placement: Placement | None,
    offset: int,
    prefetch: bool,
    fingerprint: tuple[int, ...] | None = None,
    staged: tuple[DiskStage, DiskSpan] | None = None,
) -> tuple[PendingCopy, Placement | None]:
    """Copy ``host`` to the device: into its planned ring slot when the slot is free for its unit, else into
    allocator memory (counted as a ring overflow). Returns the copy and the placement it holds, if any.

    ``fingerprint``: for a frozen tensor, the version counters that change when it is written in place
    (``frozen_fingerprint``). If the slot still holds this copy with that fingerprint, it is not made again
    (ring.py); ``None`` (a tensor that changes between steps, or one whose slot keeps derived data): always copy.
    ``staged``: a unit on the disk tier (disk.py), whose ``host`` is only its shape and identity: a copy that
    is made reads the bytes into a staging slot first; one that is not reads nothing.
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
            pending = _copy(copies, host, prefetch, out, placement.free_event, staged)
            placement.copied(offset, host, fingerprint)
        placement.hold(pending.event)
        return pending, placement
    if placement is not None:
        copies.stats.ring_overflows += 1
    return _copy(copies, host, prefetch, None, None, staged), None


def _copy(
    copies: CopyEngine,
    host: torch.Tensor,
    prefetch: bool,
    out: torch.Tensor | None,
    after: torch.cuda.Event | None,
    staged: tuple[DiskStage, DiskSpan] | None,
) -> PendingCopy:
    if staged is None:
        return copies.to_device(host, prefetch=prefetch, out=out, after=after)
    stage, span = staged
    source = stage.take(span).view(host.dtype).view(host.shape)  # a host wait until the disk read is done
    pending = copies.to_device(source, prefetch=prefetch, out=out, after=after)
    stage.copied(pending.event)  # the slot is refilled only after this copy has run
    return pending


def frozen_fingerprint(host: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of a frozen host copy and the parameters or buffers over it. An in-place write
    through either (``load_state_dict``, ``param.mul_()`` under ``no_grad``, a buffer copied back) changes one
    of them; the engine's own ``.data`` swaps do not. A write through ``.data`` is invisible to it, as it is
    to autograd."""
    return (host._version, *(t._version for t in tensors))
