"""Dequantize on arrival: a streamed NF4 weight crosses the link quantized and is dequantized once per visit.

Left to torchao, an NF4 layer dequantizes its weight inside every call, on the compute stream: with gradient
checkpointing three times per step (forward, recompute, backward's input gradient), each time about ten
kernels. For a weight the engine streams, the bytes arrive on the copy stream anyway, so the engine
dequantizes them there, right after the copy, into a plain device buffer, the room the memory plan keeps
beside each ring slot (a second allocation, sized like the slots' dequantized bytes). During compute the
parameter *is* that plain tensor: the compute stream runs the same GEMMs as an unquantized model, the
dequantization overlaps the previous unit's compute, and it runs once per visit (forward; recompute and
backward together, since the weight stays on the device from its recompute to its backward) instead of once
per call.

Exactness: torchao's ``LinearNF4`` computes ``F.linear(x, w.to(dtype))`` and ``grad_output @ w.to(dtype)``;
plain ``F.linear`` autograd with the same dequantized ``w`` runs the same two matmuls, so the values and
gradients are bit for bit the same (tests/offload/quant/test_dequantize_on_arrival.py checks it on the CPU). A
biased layer must add its bias after the matmul as torchao does (``NF4Linear``; ``quantize_frozen_weights``
gives biased layers that class). The dequantization is torchao's own ``get_original_weight`` code, run over
the payload's inner tensors as plain tensors (nf4_dequantize.py): on CUDA compiled into one kernel that writes
straight into the slot (no tensor subclass reaches the compiler, so no subclass guards run per call),
elsewhere eager.

A weight the memory budget keeps out of the ring (a unit kept on the device for good, or held from forward
to backward) is dequantized into memory of its own, and its payload's device copy is dropped: kept for good,
it is dequantized once for the whole run and computes as a plain tensor from then on. The budget counts its
dequantized bytes (``resident_nbytes``, several times its NF4 bytes), so a budget keeps fewer NF4 units
than it would keep quantized; kept quantized instead, torchao's layer would dequantize the weight in every
call (three times a step with checkpointing, on the compute stream), more device time than streaming it
takes, while an NF4 step rarely waits on the link it would save (its weights are a quarter of bf16's).

What keeps torchao's path: a copy into allocator memory rather than its ring slot (a ring overflow), an
unstreamed model, and int8 (``Int8Linear``, int8_linear.py, dequantizes in one pass per call: half NF4's
ratio of stored to dequantized bytes, so rooms for its dequantized form would cost the budget more kept
weights than the passes cost; measured on Flux.2 under 24 GiB, a dequantization on arrival was no faster).
``OffloadOptions(dequantize_on_arrival=False)`` turns it off.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from offload.arena import aligned
from offload.quant.nf4_dequantize import NF4Meta, PackedNF4, SpanLayout, dequantize_nf4_spans_into, span_layout
from offload.quant.nf4_linear import is_nf4
from offload.quant.payload import is_quantized
from offload.quant.quantized import QuantizedParamOffloader
from offload.ring import Placement, copy_into_ring
from offload.transfers import PendingCopy

# A weight kept out of the ring is kept dequantized (module docstring); False keeps it torchao's NF4 tensor,
# which bench/optimizer_quant_bench.py runs as its same-run baseline.
KEEP_DEQUANTIZED = True


def dequantizes_on_arrival(tensor: torch.Tensor) -> bool:
    """Whether a frozen quantized weight can be dequantized on arrival with torchao's exact values (NF4)."""
    return is_nf4(tensor) and not tensor.requires_grad


def dequantized_bytes(tensor: torch.Tensor) -> int:
    """Device bytes of the weight's dequantized form (its own dtype, e.g. bf16)."""
    return tensor.numel() * tensor.dtype.itemsize


def room_bytes(name: str, tensor: torch.Tensor) -> int:
    """``plan_memory``'s ``room_bytes``: a weight dequantized on arrival needs room for its dequantized form
    beside each ring slot it lands in; any other tensor none."""
    return dequantized_bytes(tensor) if is_quantized(tensor) and dequantizes_on_arrival(tensor) else 0


class DequantizedParamOffloader(QuantizedParamOffloader):
    """A frozen NF4 weight that is streamed quantized and computed with as a plain tensor (module docstring).

    Each ring slot it lands in has room for the dequantized weight (``room_bytes``, plan.py). Each copy into
    the ring is followed, on the same stream, by the dequantization into that room; the compute stream waits
    for the dequantization's event as it would for a copy. The parameter object is swapped to a plain
    ``nn.Parameter`` over the room while the unit is on the device and back to the host NF4 tensor after, so
    autograd saves a token for it (saved_tensors.py) and backward re-onloads, and re-dequantizes, it. The
    NF4 weights of one unit arrive together (``ArrivalBatch``): one copy each, then one dequantization call.
    """

    def __init__(self, name: str, tensor: torch.Tensor, copies: Any, buffer: torch.Tensor) -> None:
        self._shape, self._dtype = tensor.shape, tensor.dtype
        meta = tensor.__tensor_flatten__()[1]  # type: ignore[attr-defined]
        self.meta: NF4Meta = (tensor.shape, tensor.dtype, (meta["block_size"], meta["scaler_block_size"]))
        super().__init__(name, tensor, copies, buffer)
        self.dequantized_nbytes = dequantized_bytes(tensor)
        self.like = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")  # the room's shape, contiguous
        self._plain_over: dict[int, nn.Parameter] = {}  # room address -> the plain tensor over it
        self.room_offset = 0  # where in its slot's room the dequantized weight goes (set from the plan)
        self.dequantizations = 0
        self.batch: ArrivalBatch | None = None  # its unit's NF4 weights (set by the manager)
        self._in_batch = False  # attached to its batch's device copy (released through the batch)
        self._own_room = False  # out of the ring (the budget's): dequantized into memory of its own

    @property
    def resident_nbytes(self) -> int:
        return self.dequantized_nbytes if KEEP_DEQUANTIZED else self.nbytes

    def leave_ring(self) -> None:
        super().leave_ring()
        self._own_room = KEEP_DEQUANTIZED

    def onload(self, prefetch: bool = False) -> None:
        if self.batch is not None and self.placement is not None:
            self.batch.onload(self, prefetch)  # with the unit's other NF4 weights; it calls attach_room()
        else:
            self.onload_alone(prefetch)

    def onload_alone(self, prefetch: bool) -> None:
        """Copy and dequantize this weight by itself: into its ring slot's room, into memory of its own when the
        budget keeps it out of the ring, or (a ring overflow) not at all, torchao's path."""
        pending, self._in_ring = copy_into_ring(self.copies, self.host, self.placement, self.slot_offset, prefetch)
        if self._in_ring is None and self._own_room:  # kept out of the ring by the budget
            self._dequantize_into_own_room(pending)
            return
        if self._in_ring is None:  # allocator memory (a ring overflow): torchao's path
            self.attach(pending)
            return
        slot = self._in_ring.slot
        room = self._in_ring.room_region(self.room_offset, self.like)
        event = _dequantize_on(self.copies, pending, (room.view(-1),), slot.buffer, span_layout([self]))
        if event is not None:
            self._in_ring.wrote(event)  # a release with no wait before it must still wait for this
        self.dequantizations += 1
        self.attach_room(room, event)

    def _dequantize_into_own_room(self, pending: PendingCopy) -> None:
        """Dequantize the payload's device copy ``pending`` into a new tensor and compute with that; the payload's
        copy is dropped (only the dequantized form stays on the device)."""
        stream = _stream_of(self.copies, pending)  # where _dequantize_on runs it
        # Allocated on the stream that writes it (the allocator's reuse is safe per stream); the compute
        # stream's wait records its use of it (CopyEngine.wait, an unplanned copy).
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            room = torch.empty(self._shape, dtype=self._dtype, device=pending.tensor.device)
        layout = span_layout([PackedNF4(self.payload, 0, self.meta)])  # the payload alone, at offset 0
        # No CUDA graph: the addresses are the allocator's, seen once.
        event = _dequantize_on(self.copies, pending, (room.view(-1),), pending.tensor, layout, graphs=False)
        self.dequantizations += 1
        plain = nn.Parameter(room, requires_grad=False)
        self._swap_in(PendingCopy(room, event, planned=False), plain, self.dequantized_nbytes)

    def attach_room(self, room: torch.Tensor, event: torch.cuda.Event | None, in_batch: bool = False) -> None:
        """Make the parameter the plain tensor over ``room`` (dequantized, or being dequantized until ``event``)."""
        self._in_batch = in_batch
        self._swap_in(PendingCopy(room, event, planned=True), self._plain(room), self.nbytes + self.dequantized_nbytes)

    def _plain(self, room: torch.Tensor) -> nn.Parameter:
        return _kept(self._plain_over, room.data_ptr(), lambda: nn.Parameter(room, requires_grad=False))

    def offload(self) -> None:
        in_batch, self._in_batch = self._in_batch and self.pending is not None, False
        super().offload()
        if in_batch:
            assert self.batch is not None  # attached through it
            self.batch.detached()

    def detach(self, copy: bool = True) -> None:
        self._plain_over.clear()
        if self.batch is not None:
            self.batch.forget()
        super().detach(copy)


def _stream_of(copies: Any, pending: PendingCopy) -> torch.cuda.Stream | None:
    """The stream a dequantization after the copy ``pending`` runs on: the copy stream when prefetched (ordered
    after the copy, and before the next copy into its slot, which waits for the slot's release anyway), else
    None, the compute stream."""
    return copies.h2d_stream if pending.event is not None else None


def _dequantize_on(
    copies: Any,
    pending: PendingCopy,
    rooms: tuple[torch.Tensor, ...],
    payloads: torch.Tensor,
    layout: SpanLayout,
    graphs: bool = True,
) -> torch.cuda.Event | None:
    """Dequantize ``layout``'s weights on the stream of the copy ``pending`` (the last one of them); returns
    the event the compute stream waits for (None on the compute stream itself, where stream order suffices)."""
    stream = _stream_of(copies, pending)
    if stream is None:
        dequantize_nf4_spans_into(rooms, payloads, layout, graphs)
        return None
    with torch.cuda.stream(stream):
        dequantize_nf4_spans_into(rooms, payloads, layout, graphs)
        event = torch.cuda.Event()
        event.record(stream)
    return event


class ArrivalBatch:
    """A unit's NF4 weights dequantized on arrival, brought in together: their payloads are copied into their
    places in the unit's ring slot (one copy for payloads that lie in the arena as in the slot: ``copy_runs``),
    then one call dequantizes them all into the slot's room (a block's six weights: one call, where per-weight
    calls would each cost host time). As ``FlatGroup`` does for a span, the device copies live while any
    member is attached to them: the requester and any member a forward holds or a backward will unpack are
    attached at once, every other member when it asks (no copy, no dequantization).
    """

    def __init__(self, members: list[DequantizedParamOffloader]) -> None:
        self.dtype = members[0].like.dtype  # the rooms are viewed as one dtype (the manager groups by it)
        assert all(m.like.dtype == self.dtype for m in members)
        self.members = sorted(members, key=lambda m: m.slot_offset)  # in slot order, for the copy runs
        self.layout = span_layout(self.members)  # their places in the slot and the room: fixed
        self.runs = copy_runs(self.members)  # the copies a whole unit's arrival takes (one, as a rule)
        for member in members:
            member.batch = self
        self._attached = 0
        self._live: tuple[list[DequantizedParamOffloader], list[torch.Tensor], torch.cuda.Event | None] | None = None
        self._in_ring: Placement | None = None
        self._views_over: dict[int, tuple[list[tuple], tuple, list]] = {}  # slot -> _views_in's views
        self.calls = 0  # dequantization calls made (one per unit visit)

    def onload(self, requester: DequantizedParamOffloader, prefetch: bool) -> None:
        if self._live is None and not self._arrive(requester, prefetch):
            requester.onload_alone(prefetch)
            return
        assert self._live is not None
        arrived, rooms, event = self._live
        for member, room in zip(arrived, rooms, strict=True):
            wanted = member is requester or member.holds > 0 or member.live_tokens > 0
            if member.pending is None and wanted:
                member.attach_room(room, event, in_batch=True)
                self._attached += 1
        if requester.pending is None:  # not among those that arrived (it was resident elsewhere then)
            requester.onload_alone(prefetch)

    def _arrive(self, requester: DequantizedParamOffloader, prefetch: bool) -> bool:
        """Copy the members that are not on the device into the unit's slot and dequantize them in one call;
        False if the slot is held by another unit (the requester then goes its own way, as an overflow)."""
        placement = requester.placement
        assert placement is not None
        if not placement.claim():
            return False
        arriving = [m for m in self.members if m.pending is None and m.placement is placement]
        # Each member's payload place and room in this slot: made once per slot (a unit lands in one of
        # prefetch + 1 slots), not on every visit.
        views, flat, runs = _kept(self._views_over, placement.slot.buffer.data_ptr(), lambda: self._views_in(placement))
        layout = self.layout
        if len(arriving) < len(self.members):  # some were on the device already (outside the ring): one by one
            views = [v for v, m in zip(views, self.members, strict=True) if m in arriving]
            layout = span_layout(arriving)
            flat = _flat(views)
            runs = [(m.host, payload) for m, (payload, _) in zip(arriving, views, strict=True)]
        # The whole unit's payloads and their dequantized rooms may still be in the slot from its last visit
        # (ring.py): then neither the copies nor the dequantization are made again. Keyed by the first
        # member's place; the fingerprint is every payload's version counter (torchao's in-place writes go
        # through views of the payload buffers).
        first = self.members[0]
        fingerprint = tuple(m.host._version for m in self.members) if len(arriving) == len(self.members) else None
        if fingerprint is not None and placement.still_holds(first.slot_offset, first.host, fingerprint):
            event = placement.slot.write_event  # a copy still running ahead in the slot (ring.py), else None
            placement.hold(None)
            requester.copies.stats.reused_bytes += sum(m.nbytes for m in arriving)
        else:
            pending = None
            for host, region in runs:
                pending = requester.copies.to_device(host, prefetch=prefetch, out=region, after=placement.free_event)
            assert pending is not None  # the requester itself arrives
            placement.hold(pending.event)
            placement.copied(first.slot_offset, first.host, fingerprint)
            slot = placement.slot
            event = _dequantize_on(requester.copies, pending, flat, slot.buffer, layout)
            if event is not None:
                placement.wrote(event)  # a release with no wait before it must still wait for this
            self.calls += 1
            for member in arriving:
                member.dequantizations += 1
        self._live, self._in_ring = (arriving, [room for _, room in views], event), placement
        return True

    def _views_in(self, placement: Placement) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple, list]:
        """Each member's (payload place, room) in ``placement``'s slot, the rooms as the kernel takes them, and
        each copy run's (host bytes, slot region)."""
        views = [
            (placement.region(m.slot_offset, m.host), placement.room_region(m.room_offset, m.like))
            for m in self.members
        ]
        runs = [(host, placement.region(offset, host)) for offset, host in self.runs]
        return views, _flat(views), runs

    def detached(self) -> None:
        """A member let go of its room; with the last one the slot is released."""
        self._attached -= 1
        if self._attached == 0 and self._in_ring is not None:
            self._live = None
            self._in_ring.release(self.members[0].copies.device)
            self._in_ring = None

    def forget(self) -> None:
        self._views_over.clear()


def copy_runs(members: list[DequantizedParamOffloader]) -> list[tuple[int, torch.Tensor]]:
    """The copies that bring ``members`` (in slot order) into their slot: each run is (its slot offset, the host
    bytes it copies). Members whose payloads follow one another in the pinned arena exactly as they do
    in the slot (the plan lays out both in the same order, each payload aligned: a block's NF4 weights, unless
    an arena chunk ends among them) form one run, copied at once with the alignment padding between them: one
    copy launch and its events per block instead of one per weight (host time on a step the host bounds)."""
    runs: list[tuple[int, torch.Tensor]] = []
    start = 0
    for index in range(1, len(members) + 1):
        if index < len(members) and _follows(members[index - 1], members[index]):
            continue
        first, last = members[start], members[index - 1]
        nbytes = last.slot_offset - first.slot_offset + last.nbytes
        host = first.host if start == index - 1 else first.host.as_strided((nbytes,), (1,), first.host.storage_offset())
        runs.append((first.slot_offset, host))
        start = index
    return runs


def _follows(before: DequantizedParamOffloader, after: DequantizedParamOffloader) -> bool:
    """Whether ``after``'s payload comes right after ``before``'s, padded to the alignment, in the slot and in
    the same pinned storage (nothing else lies between them in either, so the padding may be copied)."""
    gap = aligned(before.nbytes)
    host_before, host_after = before.host, after.host
    return (
        after.slot_offset - before.slot_offset == gap
        and host_after.untyped_storage().data_ptr() == host_before.untyped_storage().data_ptr()
        and (host_after.storage_offset() - host_before.storage_offset()) * host_before.element_size() == gap
        and host_before.dtype == host_after.dtype == torch.uint8
    )


def _flat(views: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """The rooms of (payload, room) pairs as the dequantization kernel takes them: flat views."""
    return tuple(room.view(-1) for _, room in views)


def _kept(cache: dict[int, Any], address: int, make: Any) -> Any:
    """``cache[address]``, made first if missing; a ring slot's addresses recur every step, so a handful."""
    value = cache.get(address)
    if value is None:
        if len(cache) >= QuantizedParamOffloader.MAX_KEPT:
            cache.pop(next(iter(cache)))
        value = cache[address] = make()
    return value
