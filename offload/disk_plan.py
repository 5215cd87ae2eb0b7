"""Which units go to the disk tier: as few as keep the engine's pinned host memory within ``host_memory_limit``.

Every frozen weight the limit leaves room for stays in RAM; the rest is read from its checkpoint file on each
use (disk.py). The units kept in RAM are chosen as the memory budget chooses the units it keeps on the device
(schedule.py): first the small ones (under 1/16 of the largest: their reads are latency-bound, a few KB at a
time, and cost the limit almost nothing), then the large ones spread evenly over the model's order, so that the
disk reads of the others get a kept unit's compute time to run ahead in, instead of waiting out a run of
disk units back to back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from offload.arena import aligned
from offload.direct_io import align_up
from offload.disk import DiskLocator, FileRange
from offload.quant.payload import is_quantized
from offload.units import UnitPlan

Candidates = dict[int, dict[int, FileRange]]  # unit index -> id(tensor) -> its bytes on disk


def on_disk_ranges(
    units: list[UnitPlan],
    locate: DiskLocator,
    hosted: Callable[[torch.Tensor], bool],
    size: Callable[[torch.Tensor], int],
) -> Candidates:
    """The tensors each unit could read from disk: unit index -> id(tensor) -> its file range.

    Only frozen parameters held on the host in their own form qualify (not buffers, which a forward may
    update; not quantized weights, whose stored form is not the file's; not trainable masters), each in the
    first unit that holds it (a tied weight is placed once), and only where ``locate`` finds its exact bytes
    at an offset its dtype's alignment allows, for a contiguous tensor, and holding as many bytes as the
    engine streams for it (``size``: a weight the engine holds in another form, e.g. quantized, differs).
    """
    found: dict[int, dict[int, FileRange]] = {}
    seen: set[int] = set()
    for index, unit in enumerate(units):
        for name, tensor in unit.tensors:
            if id(tensor) in seen or not hosted(tensor):
                continue
            seen.add(id(tensor))
            frozen = isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad
            if not frozen or is_quantized(tensor) or not tensor.is_contiguous():
                continue
            piece = locate(name, tensor)
            nbytes = tensor.numel() * tensor.element_size()
            if piece is None or piece.nbytes != nbytes or size(tensor) != nbytes or piece.start % tensor.element_size():
                continue
            found.setdefault(index, {})[id(tensor)] = piece
    return found


def choose_disk_units(
    candidates: Candidates,
    reserved_with: Callable[[Candidates], int],
    *,
    limit: int,
    slots: int,
    bounce: Callable[[int], int] = lambda largest: 0,
) -> Candidates:
    """The candidates to put on disk so that the arena (``reserved_with(chosen)``, its bytes with ``chosen`` on
    disk) plus the staging ring (``slots`` x the largest chosen unit, and ``bounce(its bytes)`` for O_DIRECT reads) fits
    ``limit``; every candidate when even
    that does not fit (the plan then says so: ``MemoryPlan.host_fits``), none when all fits in RAM."""
    if not candidates or reserved_with({}) <= limit:
        return {}
    size = {index: sum(aligned(r.nbytes) for r in ranges.values()) for index, ranges in candidates.items()}

    def total(kept: set[int]) -> int:
        chosen = {i: r for i, r in candidates.items() if i not in kept}
        largest = max((size[i] for i in chosen), default=0)
        staging = slots * align_up(largest) + bounce(largest) if chosen else 0
        return reserved_with(chosen) + staging

    order = sorted(candidates)
    largest = max(size.values())
    small = [i for i in order if size[i] * 16 < largest]
    large = [i for i in order if size[i] * 16 >= largest]

    def kept_of(count: int) -> set[int]:
        if count <= len(small):
            return set(small[:count])
        return set(small) | set(_spread(large, count - len(small)))

    low, high = 0, len(order)  # the most units kept in RAM that fit: bisected (each try replays the arena)
    if total(set()) > limit:
        return dict(candidates)
    while low < high:
        middle = (low + high + 1) // 2
        if total(kept_of(middle)) <= limit:
            low = middle
        else:
            high = middle - 1
    kept = kept_of(low)
    return {i: r for i, r in candidates.items() if i not in kept}


def _spread(items: list[int], count: int) -> list[int]:
    """``count`` of ``items`` evenly spaced, the first and last included."""
    n = len(items)
    if count >= n:
        return list(items)
    if count == 1:
        return [items[-1]]
    return [items[round(j * (n - 1) / (count - 1))] for j in range(count)]
