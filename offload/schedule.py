"""The prefetch schedule: the order units run in, recorded during the first step, and the copies that
follow it in later steps (forward order ahead of the forward, the recorded backward order ahead of the
backward). The hooks tell it what happened; the units' own onload/prefetch API does the copying."""

from __future__ import annotations

import logging
from collections.abc import Callable

from offload.offloaders import TensorOffloader
from offload.units import OffloadUnit

log = logging.getLogger(__name__)


class PrefetchSchedule:
    """Records the first step and prefetches ``prefetch`` units ahead in the steps after it.

    With gradient checkpointing the backward order is not the reverse of forward: each block's units are
    needed in forward order (its recompute) while the blocks go in reverse. Recording the backward order as
    it happens covers that, and a plain backward, alike.
    """

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.recording = True
        self.order: list[OffloadUnit] = []
        self.unit_of: dict[int, OffloadUnit] = {}  # id(offloader) -> the first unit that used it
        self.backward_order: list[OffloadUnit] = []
        self.backward_needs: dict[int, list[TensorOffloader]] = {}  # id(unit) -> what backward onloaded
        self._backward_prefetch: dict[int, Callable[[], None]] = {}  # id(unit) -> copies those needs ahead
        self._forward_ahead: dict[int, list[OffloadUnit]] = {}  # id(unit) -> what its forward prefetches
        self.kept: set[int] = set()  # ids of the offloaders the budget holds on the device (fixed once applied)
        self.kept_bytes = 0  # their bytes
        self.kept_outside_ring_bytes = 0  # the part in memory of its own: what the budget pays for
        self.held_for_backward_bytes = 0  # trainable bytes the rest of the budget holds from forward to backward
        self.step = 0

    @property
    def streaming(self) -> set[int]:
        """ids of the units that still copy after the budget (``unit.streams``; none while step 1 records)."""
        return set() if self.recording else {id(u) for u in self.order if u.streams}

    # ----------------------------------------------------------------- what happened
    def forward_started(self, unit: OffloadUnit) -> None:
        """A unit's forward began (outside backward): record its place in the first step."""
        if self.recording and unit.index is None:
            unit.index = len(self.order)
            self.order.append(unit)
            for offloader in unit.offloaders:
                self.unit_of.setdefault(id(offloader), unit)

    def forward_onloaded(self, unit: OffloadUnit) -> None:
        """A unit is resident for its forward: copy the next units of forward while it computes."""
        for candidate in self._forward_ahead.get(id(unit), ()):
            candidate.prefetch()

    def plan_forward_prefetch(self) -> None:
        """Which units each unit's forward prefetches: the next ``prefetch`` that stream, in forward order. A
        unit the budget keeps resident copies nothing: the walk looks past it, or the copy stream idles while it
        computes and the next streamed unit is copied only once it starts. Made once each time which units
        stream changes, not in every forward: a decode step runs every unit's forward and nothing else, and a
        walk of the order per unit is host time the device waits for."""
        self._forward_ahead = {}
        if self.recording or self.prefetch == 0:
            return
        upcoming: list[OffloadUnit] = []  # the streamed units after the one at hand, nearest first
        for unit in reversed(self.order):
            if upcoming:
                self._forward_ahead[id(unit)] = upcoming[: self.prefetch]
            if unit.streams:
                upcoming = [unit, *upcoming[: self.prefetch - 1]]

    def weight_unpacked(self, offloader: TensorOffloader) -> None:
        """A backward node unpacked ``offloader``'s weight."""
        unit = self.unit_of.get(id(offloader))
        if unit is not None:
            self.backward_used(unit, [offloader])

    def backward_used(self, unit: OffloadUnit, offloaders: list[TensorOffloader]) -> None:
        """Backward needed ``offloaders`` of ``unit`` (unpacked, or recomputed under checkpointing): in the
        first step record the order; after it, prefetch what backward needed next last time."""
        if self.recording:
            if id(unit) not in self.backward_needs:
                self.backward_needs[id(unit)] = []
                unit.backward_index = len(self.backward_order)
                self.backward_order.append(unit)
            needs = self.backward_needs[id(unit)]
            needs.extend(o for o in offloaders if o.kind != "always_on_device" and o not in needs)
            return
        if self.prefetch == 0 or unit.backward_index is None or unit.backward_step == self.step:
            return
        # Only the first use in a step walks the order: later uses (a recompute's units unpacked in reverse)
        # would prefetch units whose backward is already done.
        unit.backward_step = self.step
        ahead = 0
        for candidate in self.backward_order[unit.backward_index + 1 :]:
            if ahead >= self.prefetch:
                break
            prefetch = self._backward_prefetch.get(id(candidate))
            if prefetch is not None:
                prefetch()
                ahead += 1

    def _prefetcher(self, unit: OffloadUnit) -> Callable[[], None] | None:
        """What prefetches ``unit``'s backward needs: the unit's own ``prefetch`` when backward needs every
        tensor of it that streams (a checkpointed block: its recompute onloads it all), which walks a block's
        span once; else each needed tensor's (a DiT block's dozens of per-tensor calls, where one does; host time
        on a step the host bounds). None when backward onloads nothing of it."""
        needs = self.backward_needs.get(id(unit), [])
        if not needs:
            return None
        streamed = {id(o) for o in unit.offloaders if o.kind != "always_on_device" and id(o) not in self.kept}
        if {id(o) for o in needs} == streamed:
            return unit.prefetch

        def each() -> None:
            for offloader in needs:
                offloader.prefetch()

        return each

    # ----------------------------------------------------------------- step boundaries
    def end_step(self, gpu_memory_budget: int | None) -> None:
        """After each step; after the first: fix the order, apply the budget, mark the units kept for backward."""
        self.step += 1
        if not self.recording:
            return
        self.recording = False
        self.apply_budget(gpu_memory_budget or 0)

    def apply_budget(self, gpu_memory_budget: int) -> None:
        """Hold units on the device within ``gpu_memory_budget`` (between steps, the order fixed): which
        stream from now on, what backward still onloads, and which units are kept for backward. Called once,
        after the first step, or after a later one when the budget was measured (``"auto"``)."""
        kept: set[int] = set()
        if gpu_memory_budget:
            kept = self.keep_resident_within(gpu_memory_budget)
        self.kept = kept
        for unit in self.order:
            unit.streams = any(o.kind != "always_on_device" and id(o) not in kept for o in unit.offloaders)
            unit.keep_for_backward = False
        self.plan_forward_prefetch()
        for key, needs in self.backward_needs.items():
            self.backward_needs[key] = [o for o in needs if id(o) not in kept]
        prefetchers = {id(u): self._prefetcher(u) for u in self.backward_order}
        self._backward_prefetch = {key: prefetch for key, prefetch in prefetchers.items() if prefetch is not None}
        if self.order and self.prefetch > 0:  # prefetch=0 copies on demand: offload it
            # The last unit of forward is the first of backward; so is the last one that streams (the units
            # after it are resident): keeping it saves a copy the backward would wait for at once.
            self.order[-1].keep_for_backward = True
            last_streamed = [u for u in self.order if u.streams][-1:]
            for unit in last_streamed:
                unit.keep_for_backward = True
        self.held_for_backward_bytes = 0
        if gpu_memory_budget:
            room = gpu_memory_budget - self.kept_outside_ring_bytes
            self.held_for_backward_bytes = self.hold_trainables_for_backward(room)

    def hold_trainables_for_backward(self, room: int) -> int:
        """With the budget's frozen weights placed, hold units with trainable host masters (optimizer offload)
        from their forward to their backward while their bytes fit ``room``: each is then copied once a step
        instead of twice. They cannot stay for good (the CPU optimizer changes the master every step), and
        they leave the ring: a unit held across the turnaround would keep its slot from the units that take
        turns in it. Returns the bytes held at the turnaround, the step's peak for them.

        Only the weights autograd saves for the backward stay (a checkpointed forward saves none, and its
        recompute copies again). From the forward's end: those are held the shortest time."""
        held = 0
        for unit in reversed(self.order):
            streamed = [o for o in unit.offloaders if o.kind != "always_on_device" and id(o) not in self.kept]
            if not streamed or not any(o.kind == "trainable" for o in streamed):
                continue
            nbytes = sum(o.resident_nbytes for o in streamed)
            if held + nbytes > room:
                continue
            unit.keep_for_backward = True
            unit.in_ring = False
            for offloader in streamed:
                offloader.leave_ring()
            held += nbytes
        if held:
            log.info("gpu_memory_budget: %d bytes of trainable weights held from forward to backward", held)
        return held

    def keep_resident_within(self, budget: int) -> set[int]:
        """Hold units on the device for good while their frozen tensors fit the budget; returns the ids of the
        offloaders held. Trainable host masters still stream (the CPU optimizer changes them every step).

        Which units: first the small ones (under 1/16 of the largest: little budget, and their copies are
        latency-bound and sit at the step's ends, where no compute hides them); then the large ones spread
        evenly over the forward order, the first and last included. Spread out, every resident unit gives
        the copy stream a unit's compute time to run ahead in; kept in one run (the end of forward), the
        link idles through that run while the rest of the step waits for copies.

        A kept unit that no other unit takes turns with in its ring slot (a class of its own: embeddings, a
        head, a DiT's input and output layers) stays in that slot, which the ring holds anyway: it costs the
        budget nothing. Others leave the ring for memory of their own, which the budget pays for.
        """
        frozen = {
            id(u): [o for o in u.offloaders if o.kind in ("static", "buffer") and o.holds == 0] for u in self.order
        }
        size = {key: sum(o.resident_nbytes for o in offloaders) for key, offloaders in frozen.items()}
        in_slot = {id(u) for u in self.order if size[id(u)] > 0 and _alone_in_its_slot(u, frozen[id(u)])}
        free = [u for u in self.order if id(u) in in_slot]
        candidates = [u for u in self.order if size[id(u)] > 0 and id(u) not in in_slot]
        largest = max((size[id(u)] for u in candidates), default=0)
        small = [u for u in candidates if size[id(u)] * 16 < largest]
        large = [u for u in candidates if size[id(u)] * 16 >= largest]
        in_ring, kept = 0, set()
        for unit in free:  # in their own slots: nothing to move, nothing the budget pays for
            for offloader in frozen[id(unit)]:
                offloader.acquire()
                kept.add(id(offloader))
            in_ring += size[id(unit)]
        used = 0
        for unit in small + spread(large, budget - sum(size[id(u)] for u in small), size) + large[::-1]:
            offloaders = [o for o in frozen[id(unit)] if id(o) not in kept]  # a tied weight is held once
            nbytes = sum(o.resident_nbytes for o in offloaders)
            if not offloaders or used + nbytes > budget:
                continue
            for offloader in offloaders:
                offloader.leave_ring()
                offloader.acquire()
                kept.add(id(offloader))
            used += nbytes
        log.info("gpu_memory_budget %d bytes: %d bytes of weights stay on the device, and %d more in ring slots "
                 "of their own", budget, used, in_ring)  # fmt: skip
        self.kept_bytes, self.kept_outside_ring_bytes = used + in_ring, used
        return kept


def _alone_in_its_slot(unit: OffloadUnit, frozen: list[TensorOffloader]) -> bool:
    """Whether ``unit`` can stay in its ring slot for good: it is the only unit placed there, and all it
    streams is plain frozen weights the budget would keep (no trainable master that still streams, no weight
    kept in another form than it streams in)."""
    streamed = [o for o in unit.offloaders if o.kind != "always_on_device"]
    placements = {id(o.placement): o.placement for o in streamed if o.placement is not None}
    placements.update({id(o.group.placement): o.group.placement for o in streamed
                       if o.group is not None and o.group.placement is not None})  # fmt: skip
    return (
        len(placements) == 1
        and all(p.alone for p in placements.values())
        and len(streamed) == len(frozen)
        and all(o.resident_nbytes == o.nbytes for o in frozen)
    )


def spread(units: list[OffloadUnit], budget: int, size: dict[int, int]) -> list[OffloadUnit]:
    """The most units, evenly spaced in ``units`` (first and last included), whose sizes fit ``budget``."""
    n = len(units)
    for count in range(n, 0, -1):
        picks = [units[round(j * (n - 1) / (count - 1))] if count > 1 else units[-1] for j in range(count)]
        if sum(size[id(u)] for u in picks) <= budget:
            return picks
    return []
