"""Dequantize on arrival: a streamed NF4 weight crosses the link quantized and is dequantized once per visit.

Left to torchao, an NF4 layer dequantizes its weight inside every call, on the compute stream: with gradient
checkpointing three times per step (forward, recompute, backward's input gradient), each time about ten
kernels. For a weight the engine streams, the bytes arrive on the copy stream anyway, so the engine
dequantizes them there, right after the copy, into a plain device buffer, the room the memory plan keeps
beside each ring slot (a second allocation, sized like the slots' dequantized bytes). During compute the parameter *is* that plain tensor: the
compute stream runs the same GEMMs as an unquantized model, the dequantization overlaps the previous unit's
compute, and it runs once per visit (forward; recompute and backward together, since the weight stays on
the device from its recompute to its backward) instead of once per call.

Exactness: torchao's ``LinearNF4`` computes ``F.linear(x, w.to(dtype))`` and ``grad_output @ w.to(dtype)``;
plain ``F.linear`` autograd with the same dequantized ``w`` runs the same two matmuls, so the values and
gradients are bit for bit the same (tests/offload/test_dequantize_on_arrival.py checks it on the CPU). A
biased layer must add its bias after the matmul as torchao does (``NF4Linear``; ``quantize_frozen_weights``
gives biased layers that class). The dequantization is torchao's own ``get_original_weight`` code, run over
the payload's inner tensors as plain tensors: on CUDA compiled into one kernel that writes straight into
the slot (no tensor subclass reaches the compiler, so no subclass guards run per call), elsewhere eager.

What keeps torchao's path: a copy that did not land in the ring (a ring overflow, or a unit the memory budget
keeps on the device for good, whose bf16 form would cost 3.5x its device memory), an unstreamed model, and
int8 (torchao's int8 linear scales after the matmul, so a dequantized weight would not give its values).
``OffloadOptions(dequantize_on_arrival=False)`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from offload.nf4_linear import is_nf4
from offload.offloaders import copy_into_ring
from offload.quantized import QuantizedParamOffloader, is_quantized
from offload.transfers import PendingCopy

log = logging.getLogger(__name__)


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


@functools.cache
def _eager() -> Callable[..., None]:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    class NF4Parts:
        """What torchao's ``NF4Tensor.get_original_weight`` reads, as plain attributes: its own code then
        runs over plain tensors (eager, or traced by torch.compile without the subclass)."""

        get_original_weight = NF4Tensor.get_original_weight
        dequantize_scalers = NF4Tensor.dequantize_scalers
        dequantize = staticmethod(NF4Tensor.dequantize)

        def __init__(
            self, inner: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype, blocks: tuple
        ) -> None:
            self.quantized_data, self.nf4 = inner["quantized_data"], inner["nf4"]
            self.quantized_scalers, self.quantization_factor = inner["quantized_scalers"], inner["quantization_factor"]
            self.scaler_mean = inner["scaler_mean"]
            self.shape, self.dtype = shape, dtype
            self.block_size, self.scaler_block_size = blocks

    def dequantize_into(
        out: torch.Tensor, inner: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype, blocks: tuple
    ) -> None:
        out.copy_(NF4Parts(inner, shape, dtype, blocks).get_original_weight())

    return dequantize_into


@functools.cache
def _compiled() -> Callable[..., None]:
    # One graph per weight shape (dynamic=False): a model has a handful of projection shapes. The copy into
    # ``out`` stays in the graph, so the kernel writes the ring slot directly. emulate_precision_casts rounds
    # each intermediate as eager does: torchao's values, bit for bit.
    return torch.compile(_eager(), fullgraph=True, dynamic=False, options=dict(COMPILE_OPTIONS))


COMPILE_ON_CUDA = True  # bench/optimizer_quant_bench.py measures both kernels
COMPILE_OPTIONS = {"emulate_precision_casts": True}
_COMPILE_FAILED: list[BaseException] = []


def dequantize_nf4_into(
    out: torch.Tensor, inner: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype, blocks: tuple[int, int]
) -> None:
    """Write torchao's dequantization of the NF4 payload ``inner`` (its inner tensors by name; ``blocks``: its
    block and scaler block sizes) into ``out``, on the current stream: one compiled kernel on CUDA, torchao's
    eager ops elsewhere (or if compiling fails, with a warning, once)."""
    with torch.no_grad():
        if out.is_cuda and COMPILE_ON_CUDA and not _COMPILE_FAILED:
            try:
                _compiled()(out, inner, shape, dtype, blocks)
                return
            except Exception as error:  # any compiler failure: the eager path writes the same values
                _COMPILE_FAILED.append(error)
                log.warning("NF4 dequantization on arrival runs eagerly (torch.compile failed: %r)", error)
        _eager()(out, inner, shape, dtype, blocks)


class DequantizedParamOffloader(QuantizedParamOffloader):
    """A frozen NF4 weight that is streamed quantized and computed with as a plain tensor (module docstring).

    Each ring slot it lands in has room for the dequantized weight (``room_bytes``, plan.py). Each copy into
    the ring is followed, on the same stream, by the dequantization into that room; the compute stream waits
    for the dequantization's event as it would for a copy. The parameter object is swapped to a plain
    ``nn.Parameter`` over the room while the unit is on the device and back to the host NF4 tensor after, so
    autograd saves a token for it (saved_tensors.py) and backward re-onloads, and re-dequantizes, it.
    """

    def __init__(self, name: str, tensor: torch.Tensor, copies: Any, buffer: torch.Tensor) -> None:
        self._shape, self._dtype = tensor.shape, tensor.dtype
        meta = tensor.__tensor_flatten__()[1]  # type: ignore[attr-defined]
        self._blocks = (meta["block_size"], meta["scaler_block_size"])
        super().__init__(name, tensor, copies, buffer)
        self.dequantized_nbytes = dequantized_bytes(tensor)
        self._like = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")  # the room's shape, contiguous
        self._inner_over: dict[int, dict[str, torch.Tensor]] = {}  # payload address -> its inner views
        self._plain_over: dict[int, nn.Parameter] = {}  # room address -> the plain tensor over it
        self.room_offset = 0  # where in its slot's room the dequantized weight goes (set from the plan)
        self.dequantizations = 0

    def onload(self, prefetch: bool = False) -> None:
        pending, self._in_ring = copy_into_ring(self.copies, self.host, self.placement, self.slot_offset, prefetch)
        if self._in_ring is None:  # allocator memory (an overflow, a unit kept for good): torchao's path
            self.attach(pending)
            return
        room = self._in_ring.room_region(self.room_offset, self._like)
        # The copy's stream: on the copy stream when prefetched (ordered after the copy, and before the next
        # copy into this slot, which waits for the slot's release anyway), else on the compute stream.
        stream = self.copies.h2d_stream if pending.event is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dequantize_nf4_into(room, self._inner(pending.tensor), self._shape, self._dtype, self._blocks)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                self._in_ring.wrote(event)  # a release with no wait before it must still wait for this
        self.dequantizations += 1
        self._swap_in(PendingCopy(room, event, planned=True), self._plain(room), self.nbytes + self.dequantized_nbytes)

    def _inner(self, payload: torch.Tensor) -> dict[str, torch.Tensor]:
        return _kept(self._inner_over, payload.data_ptr(), lambda: self.payload.views(payload))

    def _plain(self, room: torch.Tensor) -> nn.Parameter:
        return _kept(self._plain_over, room.data_ptr(), lambda: nn.Parameter(room, requires_grad=False))

    def detach(self) -> None:
        self._inner_over.clear()
        self._plain_over.clear()
        super().detach()


def _kept(cache: dict[int, Any], address: int, make: Any) -> Any:
    """``cache[address]``, made first if missing; a ring slot's addresses recur every step, so a handful."""
    value = cache.get(address)
    if value is None:
        if len(cache) >= QuantizedParamOffloader.MAX_KEPT:
            cache.pop(next(iter(cache)))
        value = cache[address] = make()
    return value
