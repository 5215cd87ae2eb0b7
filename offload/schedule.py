"""The prefetch schedule: the order units run in, recorded during the first step, and the copies that
follow it in later steps (forward order ahead of the forward, the recorded backward order ahead of the
backward). The hooks tell it what happened; the units' own onload/prefetch API does the copying."""

from __future__ import annotations

import logging

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
        self.step = 0

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
        if self.recording or unit.index is None or self.prefetch == 0:
            return
        ahead = 0
        for candidate in self.order[unit.index + 1 :]:
            if ahead >= self.prefetch:
                break
            if candidate.streamed_bytes:
                candidate.prefetch()
                ahead += 1

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
            needs = self.backward_needs[id(candidate)]
            if needs:
                for offloader in needs:
                    offloader.prefetch()
                ahead += 1

    # ----------------------------------------------------------------- step boundaries
    def end_step(self, gpu_memory_budget: int | None) -> None:
        """After each step; after the first: fix the order, mark the last unit, apply the budget."""
        self.step += 1
        if not self.recording:
            return
        self.recording = False
        if self.order and self.prefetch > 0:  # prefetch=0 is the seed's behaviour: offload it
            self.order[-1].keep_for_backward = True
        if gpu_memory_budget:
            self.keep_resident_within(gpu_memory_budget)

    def keep_resident_within(self, budget: int) -> None:
        """Hold units on the device for good, from the end of forward (the start of backward) backwards,
        while their frozen tensors fit the budget. Trainable host masters still stream (the CPU optimizer
        changes them every step)."""
        used = 0
        for unit in reversed(self.order):
            frozen = [o for o in unit.offloaders if o.kind in ("static", "buffer") and o.holds == 0]
            size = sum(o.nbytes for o in frozen)
            if used + size > budget:
                break
            for offloader in frozen:
                offloader.leave_ring()
                offloader.acquire()
            used += size
        log.info("gpu_memory_budget %d bytes: %d bytes of weights stay on the device", budget, used)
