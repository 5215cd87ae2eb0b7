"""The memory plan: where every streamed byte lives, on the host and on the device, decided before the first step.

Host side: the order and sizes of the pinned arena's allocations (a block's span, then each other host copy,
a trainable master's gradient buffer right after it), replayed on a dry-run arena for the bytes it reserves.

Device side: a ring of device buffers that copies write into and compute reads from, instead of memory the
caching allocator hands out per stream (with side-stream copies that reserves far more than is allocated:
each stream keeps its own freed blocks).
Units at the same place in the repeated blocks (``layers.3`` and ``layers.4``; or ``layers.3.attn.q`` and
``layers.4.attn.q``) with the same layout form a ring class of ``prefetch + 1`` slots of that layout's size;
the n-th unit of a class lands in slot ``n % depth``. Every other unit is a class of its own with one slot.
Classes follow places, not sizes: with gradient checkpointing a block's leaves are all resident during its
recompute, so two same-sized leaves of one block must never take turns in one slot. So the device memory
for weights is ``sum over classes of depth x slot size`` and is known before the first step, and block units
never need more than leaf units at the same prefetch depth: a block slot is the sum of its leaves' slots.

The engine builds itself from this plan and ``jobs``' estimate reads it (``offload.plan_memory``), so the two
never disagree. Sizes are the bytes that cross the link (``link_bytes``): a unit whose host copy is stored in
another form (quantized frozen weights) plans with its stored bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from offload.arena import PinnedArenaPool, aligned
from offload.direct_io import align_up
from offload.disk import DiskLocator, FileRange, bounce_bytes
from offload.disk_plan import choose_disk_units, on_disk_ranges
from offload.options import OffloadOptions
from offload.quant.payload import is_quantized
from offload.ring import RingClass
from offload.shards import OptimizerShard
from offload.units import UnitPlan, discover_units

LinkBytes = Callable[[str, torch.Tensor], int]


def tensor_bytes(name: str, tensor: torch.Tensor) -> int:
    """The default ``link_bytes``: the tensor as it is (``numel x element_size``, at least one element)."""
    return max(1, tensor.numel()) * tensor.element_size()


@dataclass(frozen=True)
class UnitLayout:
    """One unit's place in the plan.

    Attributes:
        name: the unit's name (as discovered).
        span: ids of the tensors copied together as one span (block granularity), largest first.
        solo: ids of the other tensors this unit streams, each copied on its own, largest first.
        offsets: each placed item's byte offset in the unit's device slot; the span's key is ``0``.
        slot_bytes: the bytes of one slot of the unit's ring class (0: the unit streams nothing of its own).
        ring_class: index into ``MemoryPlan.ring_classes`` (``None`` with ``slot_bytes == 0``).
        slot: which slot of its class the unit lands in.
        room_offsets: each weight dequantized on arrival's byte offset in its slot's room (plan_memory).
        disk: on the disk tier (disk.py): the file range of each tensor of ``span``, in its order; the span
            then has no host memory (empty: in RAM).
    """

    name: str
    span: tuple[int, ...]
    solo: tuple[int, ...]
    offsets: dict[int, int]
    slot_bytes: int
    ring_class: int | None
    slot: int
    room_offsets: dict[int, int] = field(default_factory=dict)
    disk: tuple[FileRange, ...] = ()


@dataclass(frozen=True)
class MemoryPlan:
    """The engine's memory plan for a model (see the module docstring).

    Attributes:
        units: the units as discovered, in order.
        layouts: one per unit, same order.
        ring_classes: the device ring's classes; ``ring_bytes`` is their total.
        ring_bytes: device bytes the engine allocates for streamed weights, once, at setup (rooms included).
        room_bytes: the part of ``ring_bytes`` that holds dequantized weights (``room_bytes`` of plan_memory).
        host_sizes: the pinned arena's allocations in the order the engine makes them.
        pinned_reserved_bytes / pinned_requested_bytes: what the arena reserves / what the tensors need.
        streamed_bytes: bytes of every streamed tensor once (one pass of the model over the link).
        largest_unit_bytes: the largest slot.
        device_trainables: ids of the trainable parameters that stay on the device with their optimizer
            although optimizer offload is on (``trainables_on_device``); ``device_trainable_bytes``: the
            budget they take (``OPTIMIZER_ON_DEVICE_FACTOR`` times their bytes).
        activation_reserved_bytes / activation_requested_bytes: with ``offload_activations``, what the pinned
            arena for checkpointed inputs (activations.py) reserves / what ``activation_host_bytes`` needs.
        disk_bytes: frozen weight bytes on the disk tier (``host_memory_limit``; disk_plan.py), read from
            their files on each use; ``staging_slots`` x ``staging_slot_bytes`` (4096-aligned), its pinned
            staging ring, plus ``staging_bounce_bytes`` for O_DIRECT reads = ``staging_bytes``.
        disk_io: how the disk tier reads: ``OffloadOptions.disk_io``, but ``buffered`` where ``auto``'s bounce
            buffers are what would not fit ``host_memory_limit`` (a model of small units).
        host_memory_limit: the limit the plan was made for (``None``: none).
    """

    units: list[UnitPlan]
    layouts: list[UnitLayout]
    ring_classes: list[RingClass]
    ring_bytes: int
    room_bytes: int
    host_sizes: list[int] = field(repr=False)
    pinned_reserved_bytes: int
    pinned_requested_bytes: int
    streamed_bytes: int
    largest_unit_bytes: int
    device_trainables: frozenset[int] = frozenset()
    device_trainable_bytes: int = 0
    activation_reserved_bytes: int = 0
    activation_requested_bytes: int = 0
    disk_bytes: int = 0
    staging_slots: int = 0
    staging_slot_bytes: int = 0
    staging_bounce_bytes: int = 0
    disk_io: str = "auto"
    host_memory_limit: int | None = None

    @property
    def staging_bytes(self) -> int:
        # Slots on O_DIRECT's 4096-byte boundaries, as the stage lays them out (disk.py).
        ring = self.staging_slots * align_up(self.staging_slot_bytes)
        return ring + self.staging_bounce_bytes if self.disk_bytes else 0

    @property
    def host_bytes(self) -> int:
        """The pinned host memory the engine holds: its arena, the staging ring, the checkpointed inputs' arena."""
        return self.pinned_reserved_bytes + self.staging_bytes + self.activation_reserved_bytes

    @property
    def host_fits(self) -> bool:
        """Whether ``host_bytes`` is within ``host_memory_limit`` (always, without one)."""
        return self.host_memory_limit is None or self.host_bytes <= self.host_memory_limit

    def describe(self) -> str:
        """One line for logs and estimate notes."""
        disk = (
            f"; {self.disk_bytes / 2**30:.2f} GiB of frozen weights read from disk through a "
            f"{self.staging_bytes / 2**30:.2f} GiB staging ring"
            if self.disk_bytes
            else ""
        )
        return (
            f"device ring {self.ring_bytes / 2**30:.2f} GiB in {len(self.ring_classes)} class(es), largest unit "
            f"{self.largest_unit_bytes / 2**30:.2f} GiB; pinned arena {self.pinned_reserved_bytes / 2**30:.2f} GiB "
            f"for {self.pinned_requested_bytes / 2**30:.2f} GiB of host copies{disk}"
        )


def split_threshold_bytes(threshold_mb: float | None) -> int | None:
    """``cpu_offload_split_threshold`` (MB) in bytes, validated."""
    if threshold_mb is None:
        return None
    if isinstance(threshold_mb, bool) or not isinstance(threshold_mb, (int, float)) or threshold_mb <= 0:
        raise ValueError(f"cpu_offload_split_threshold must be a positive number of MB (or None); got {threshold_mb!r}")
    return int(threshold_mb * 2**20)


def plan_memory(
    model: nn.Module,
    *,
    enable_optimizer_cpu_offload: bool = False,
    cpu_offload_split_threshold: float | None = None,
    options: OffloadOptions | None = None,
    link_bytes: LinkBytes = tensor_bytes,
    room_bytes: LinkBytes | None = None,
    optimizer_shard: OptimizerShard | None = None,
    disk: DiskLocator | None = None,
) -> MemoryPlan:
    """The engine's plan for ``model``: the same arguments as ``OffloadTrainingManager``; nothing is allocated.

    ``link_bytes``: a tensor's bytes in the pinned arena, over the link and in its ring slot; ``room_bytes``:
    the bytes of its dequantized form, for a quantized weight dequantized on arrival (0 for any other), planned
    as a room beside each of its slots in a second device buffer (the dequantization writes it while the
    payload is read, so the two must not share an allocation: torch.compile refuses writes into an input
    that aliases another). ``optimizer_shard``: each trainable master's gradient buffer holds this rank's part
    only (shards.py). ``disk``: where frozen weights lie in their checkpoint files; with
    ``options.host_memory_limit`` the units that would not fit are planned on the disk tier (disk_plan.py).

    Works on a model built on the meta device (shapes only), which is how a job's memory is estimated
    before it is queued.

    Example:
        >>> plan = plan_memory(model, options=OffloadOptions(granularity="block"))
        >>> plan.ring_bytes  # device bytes for streamed weights, whatever the step does
    """
    options = options if options is not None else OffloadOptions()
    threshold = split_threshold_bytes(cpu_offload_split_threshold)
    granularity = options.granularity if threshold is None else "leaf"
    units = discover_units(model, threshold, granularity, whole_units=options.whole_units)
    names = {id(t): name for unit in units for name, t in unit.tensors}

    def size(tensor: torch.Tensor) -> int:
        return max(1, link_bytes(names[id(tensor)], tensor))

    def room(tensor: torch.Tensor) -> int:
        return aligned(room_bytes(names[id(tensor)], tensor)) if room_bytes is not None else 0

    def trainable(tensor: torch.Tensor) -> bool:
        return isinstance(tensor, nn.Parameter) and tensor.requires_grad

    on_device, on_device_bytes = trainables_on_device(
        units, options.gpu_memory_budget if enable_optimizer_cpu_offload else None, size
    )

    def hosted(tensor: torch.Tensor) -> bool:
        return not trainable(tensor) or (enable_optimizer_cpu_offload and id(tensor) not in on_device)

    def drafts_with(on_disk: dict[int, dict[int, FileRange]]) -> tuple[list[int], list[_Draft]]:
        """The arena's allocations and each unit's draft layout, with the units ``on_disk`` (index -> the file
        range of each of its tensors on the disk tier) holding those tensors in no host memory."""
        placed: set[int] = set()
        host_sizes: list[int] = []
        drafts = []
        for index, unit in enumerate(units):
            ordered = [t for _, t in sorted(unit.tensors, key=lambda nt: -size(nt[1]))]
            new = [t for t in dict.fromkeys(ordered) if id(t) not in placed and hosted(t)]
            ranges = on_disk.get(index, {})
            # Spans hold what never changes; a quantized weight is sent as its own payload (quantized.py). A
            # unit on disk copies its disk tensors as one span (one read, one copy), whatever the granularity.
            frozen = [t for t in new if not trainable(t) and not is_quantized(t)]
            if ranges:
                span = [t for t in frozen if id(t) in ranges]
            else:
                span = frozen if unit.flat and len(frozen) > 1 else []
            solo = [t for t in new if not any(t is s for s in span)]
            if span and not ranges:
                host_sizes.append(sum(aligned(size(t)) for t in span))
            for tensor in solo:
                host_sizes.append(size(tensor))
                if trainable(tensor):  # the host gradient buffer (this rank's part of it), right after its master
                    host_sizes.append(
                        gradient_buffer_bytes(tensor, optimizer_shard) if optimizer_shard else size(tensor)
                    )
            placed.update(id(t) for t in new)
            items = ([sum(aligned(size(t)) for t in span)] if span else []) + [aligned(size(t)) for t in solo]
            rooms = [room(t) if not trainable(t) else 0 for t in solo]  # only frozen weights are dequantized
            disk_ranges = tuple(ranges[id(t)] for t in span) if ranges else ()
            drafts.append(
                (unit.name, tuple(id(t) for t in span), tuple(id(t) for t in solo), items, rooms, disk_ranges)
            )
        return host_sizes, drafts

    def pinned(host_sizes: list[int]) -> tuple[int, int]:
        arena = PinnedArenaPool(sum(aligned(n) for n in host_sizes), pin=False, dry_run=True)
        for nbytes in host_sizes:
            arena.allocate((nbytes,), torch.uint8)
        return arena.reserved_bytes, arena.requested_bytes

    # The checkpointed inputs' own arena (activations.py), replayed with the sizes the job planned.
    saved = list(options.activation_host_bytes) if options.offload_activations else []
    activations = PinnedArenaPool(sum(aligned(n) for n in saved), pin=False, dry_run=True)
    for nbytes in saved:
        activations.allocate((nbytes,), torch.uint8)
    limit = options.host_memory_limit if isinstance(options.host_memory_limit, int) else None
    candidates = on_disk_ranges(units, disk, hosted, size) if disk is not None and limit is not None else {}
    slots = options.disk_read_ahead + 1
    host_room = (limit or 0) - activations.reserved_bytes

    def disk_units(disk_io: str) -> tuple[dict[int, dict[int, FileRange]], bool]:
        """The units on disk reading as ``disk_io``, and whether the arena and staging then fit ``host_room``."""
        chosen = choose_disk_units(
            candidates,
            lambda chosen: pinned(drafts_with(chosen)[0])[0],
            limit=host_room,
            slots=slots,
            bounce=lambda largest: bounce_bytes(disk_io, largest),
        )
        largest = max((sum(aligned(r.nbytes) for r in ranges.values()) for ranges in chosen.values()), default=0)
        staging = slots * align_up(largest) + bounce_bytes(disk_io, largest) if chosen else 0
        return chosen, pinned(drafts_with(chosen)[0])[0] + staging <= host_room

    disk_io = options.disk_io
    on_disk, fits = disk_units(disk_io)
    if on_disk and not fits and disk_io == "auto":  # O_DIRECT's bounce buffers are what does not fit: read buffered
        buffered, buffered_fits = disk_units("buffered")
        if buffered_fits:
            on_disk, disk_io = buffered, "buffered"
    host_sizes, drafts = drafts_with(on_disk)
    disk_sizes = [sum(aligned(r.nbytes) for r in draft[5]) for draft in drafts if draft[5]]
    classes, layouts = _ring(drafts, options.prefetch)
    reserved, requested = pinned(host_sizes)
    streamed = sum(n for draft in drafts for n in draft[3])
    return MemoryPlan(
        units=units,
        layouts=layouts,
        ring_classes=classes,
        ring_bytes=sum(c.nbytes + c.room_nbytes for c in classes),
        room_bytes=sum(c.room_nbytes for c in classes),
        host_sizes=host_sizes,
        pinned_reserved_bytes=reserved,
        pinned_requested_bytes=requested,
        streamed_bytes=streamed,
        largest_unit_bytes=max((c.slot_bytes for c in classes), default=0),
        device_trainables=frozenset(on_device),
        device_trainable_bytes=on_device_bytes,
        activation_reserved_bytes=activations.reserved_bytes,
        activation_requested_bytes=activations.requested_bytes,
        disk_bytes=sum(disk_sizes),
        staging_slots=slots if disk_sizes else 0,
        staging_slot_bytes=max(disk_sizes, default=0),
        staging_bounce_bytes=bounce_bytes(disk_io, max(disk_sizes, default=0)),
        disk_io=disk_io,
        host_memory_limit=limit,
    )


def gradient_buffer_bytes(tensor: torch.Tensor, shard: OptimizerShard) -> int:
    """The arena bytes of a trainable master's host gradient buffer that holds ``shard``'s part of it."""
    return max(1, shard.part(tensor.numel()).numel) * tensor.element_size()


# Device bytes per byte of a trainable weight kept on the device with its optimizer: the weight, its gradient
# and AdamW's two moments (SGD with momentum needs three, plain SGD two: the budget is then not filled).
OPTIMIZER_ON_DEVICE_FACTOR = 4


def trainables_on_device(
    units: list[UnitPlan], budget: int | str | None, size: Callable[[torch.Tensor], int]
) -> tuple[set[int], int]:
    """With optimizer offload and a set ``gpu_memory_budget``: the trainable parameters that stay on the device
    with their optimizer, and the budget they take. Returns (their ids, bytes).

    With optimizer offload the CPU optimizer's update, not the device, tends to bound the step, so the budget
    goes first to taking updates off the CPU: each parameter kept on the device is updated there by the user's
    own optimizer, in ``optimizer.step()``. From the model's first parameters on (registration order, the
    forward's for a stack of layers): in an exact step the next forward waits first for the first layers'
    updates, whose gradients the backward makes last. Up to the first one that does not fit, so the kept ones
    are a prefix. ``"auto"`` is measured after the optimizer exists, too late to choose where its state lives:
    none.
    """
    if not isinstance(budget, int) or budget <= 0:
        return set(), 0
    chosen: set[int] = set()
    used = 0
    for unit in units:
        for _, tensor in unit.tensors:
            if not (isinstance(tensor, nn.Parameter) and tensor.requires_grad) or id(tensor) in chosen:
                continue
            need = OPTIMIZER_ON_DEVICE_FACTOR * size(tensor)
            if used + need > budget:
                return chosen, used
            chosen.add(id(tensor))
            used += need
    return chosen, used


_Draft = tuple[str, tuple[int, ...], tuple[int, ...], list[int], list[int], tuple[FileRange, ...]]


def _ring(drafts: list[_Draft], prefetch: int) -> tuple[list[RingClass], list[UnitLayout]]:
    """Group units by layout into ring classes; give each unit its class and slot (round-robin in order)."""
    by_shape: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for index, (name, _, _, items, rooms, _) in enumerate(drafts):
        if items:
            by_shape.setdefault((_place(name), tuple(items), tuple(rooms)), []).append(index)
    classes: list[RingClass] = []
    class_of: dict[int, tuple[int, int]] = {}
    offset = room_offset = 0
    for (_, sizes, room_sizes), members in by_shape.items():
        # prefetch=0 copies on demand: one slot per class. Otherwise the unit computing plus ``prefetch``
        # ahead; a class never needs more slots than it has members.
        depth = min(len(members), prefetch + 1) if prefetch > 0 else 1
        klass = RingClass(
            slot_bytes=sum(sizes),
            depth=depth,
            members=len(members),
            offset=offset,
            room_bytes=sum(room_sizes),
            room_offset=room_offset,
        )
        offset += klass.nbytes
        room_offset += klass.room_nbytes
        for position, index in enumerate(members):
            class_of[index] = (len(classes), position % depth)
        classes.append(klass)
    layouts = []
    for index, (name, span, solo, items, rooms, disk) in enumerate(drafts):
        keys = ((0,) if span else ()) + solo
        offsets, at = {}, 0
        for key, nbytes in zip(keys, items, strict=True):
            offsets[key] = at
            at += nbytes
        room_offsets, at = {}, 0
        for key, nbytes in zip(solo, rooms, strict=True):
            if nbytes:
                room_offsets[key] = at
                at += nbytes
        ring_class, slot = class_of.get(index, (None, 0))
        layouts.append(UnitLayout(name, span, solo, offsets, sum(items), ring_class, slot, room_offsets, disk))
    return classes, layouts


def _place(name: str) -> str:
    """A unit's place in the repeated structure: its name with the first index (the layer's) wildcarded."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            parts[i] = "*"
            break
    return ".".join(parts)
