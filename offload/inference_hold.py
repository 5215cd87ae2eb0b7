"""Holding the streamed units on the device through a forward-only phase (a decode loop) that fits the device.

A training budget (``gpu_memory_budget``) leaves on the device what training's peak leaves room for: activations
kept for the backward, gradients, optimizer state. A decode loop keeps none of those, only its KV cache, and
runs every unit's forward once per token: streamed, each unit crosses the link once per decode step. When the
units that stream fit in what the limit leaves beside what the engine holds, the cache and the loop's working
memory, each is copied once at the start and dropped at the end instead (before training's forward needs the
memory back).

Held units leave the ring for memory of their own for the phase (they are all resident at once, and the ring
slots are shared by turns); the units that do not fit keep streaming through the ring. Their placements are put
back afterwards, so the next step streams as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from offload.flat import FlatGroup
from offload.offloaders import TensorOffloader
from offload.options import format_bytes
from offload.quant.dequantize_on_arrival import DequantizedParamOffloader
from offload.ring import Placement
from offload.units import OffloadUnit

log = logging.getLogger(__name__)

HOLDABLE_KINDS = ("static", "buffer", "trainable")  # kinds whose residency outside the ring is plain memory


@dataclass
class InferenceHold:
    """What a forward-only phase holds on the device: ``units`` of the ``streamed`` ones, ``nbytes`` in all;
    ``room`` is the bytes the accounting left for them (``None``: no limit to keep to)."""

    units: int = 0
    streamed: int = 0
    nbytes: int = 0
    room: int | None = None
    _held: list[OffloadUnit] = field(default_factory=list, repr=False)
    _placements: list[tuple[TensorOffloader, Placement | None]] = field(default_factory=list, repr=False)
    _group_placements: dict[int, tuple[FlatGroup, Placement | None]] = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        """One line for the log: how many units generation keeps on the device, and why not more."""
        if not self.streamed:
            return "generation streams nothing: every unit is kept on the device"
        room = "no limit" if self.room is None else f"{format_bytes(max(self.room, 0))} of room"
        return (
            f"generation kept {self.units} of {self.streamed} streamed units on the device "
            f"({format_bytes(self.nbytes)}, {room}); the other {self.streamed - self.units} stream per decode step"
        )


def streamed_offloaders(unit: OffloadUnit, kept: set[int]) -> list[TensorOffloader]:
    """The tensors of ``unit`` that cross the link on each of its onloads."""
    return [o for o in unit.offloaders if o.kind != "always_on_device" and id(o) not in kept]


def holdable(unit: OffloadUnit, kept: set[int]) -> bool:
    """Whether ``unit`` can leave the ring for the phase: plain frozen weights, buffers or host masters, none on the
    disk tier (its reads follow the recorded order) and none dequantized on arrival (kept in another form than it
    streams in)."""
    streamed = streamed_offloaders(unit, kept)
    return all(
        o.kind in HOLDABLE_KINDS
        and not isinstance(o, DequantizedParamOffloader)
        and (o.group is None or o.group.disk is None)
        for o in streamed
    )


def hold_units(units: list[OffloadUnit], kept: set[int], room: int | None) -> InferenceHold:
    """Onload the streaming ``units`` that fit ``room`` bytes (all of them for ``None``), in forward order, each
    into memory of its own, and mark them as not streaming; ``release`` undoes it."""
    streaming = [u for u in units if u.streams and streamed_offloaders(u, kept)]  # (step 1: every unit streams)
    hold = InferenceHold(streamed=len(streaming), room=room)
    for unit in streaming:
        offloaders = streamed_offloaders(unit, kept)
        nbytes = sum(o.resident_nbytes for o in offloaders)
        if not holdable(unit, kept) or (room is not None and hold.nbytes + nbytes > room):
            continue
        for offloader in offloaders:
            group = offloader.group
            if group is not None and id(group) not in hold._group_placements:  # before its first member leaves
                hold._group_placements[id(group)] = (group, group.placement)
            hold._placements.append((offloader, offloader.placement))
            offloader.leave_ring()
        unit.onload()
        unit.streams = False  # its hooks skip the copy and the bookkeeping from here
        hold._held.append(unit)
        hold.nbytes += nbytes
        hold.units += 1
    return hold


def release_units(hold: InferenceHold) -> None:
    """Drop what ``hold_units`` onloaded and put every placement back: the units stream as before."""
    with torch.no_grad():  # no unit stays for a backward
        for unit in hold._held:
            unit.streams = True
            unit.offload()
    for offloader, placement in hold._placements:
        offloader.placement = placement
    for group, placement in hold._group_placements.values():
        group.placement = placement
    hold._held.clear()
    hold._placements.clear()
    hold._group_placements.clear()
