"""torchao's NF4 dequantization run over a payload's plain inner tensors, written into device buffers: the
kernels that ``dequantize_on_arrival.py`` calls right after a unit's NF4 payloads reach its ring slot.

The code is torchao's own ``NF4Tensor.get_original_weight`` (so the values are torchao's, bit for bit), run over
plain tensors rather than the tensor subclass: eagerly, or on CUDA traced by ``torch.compile`` into one graph
per unit layout, with no subclass guards to run per call. ``COMPILE_ON_CUDA``, ``COMPILE_ON_CPU`` and
``COMPILE_OPTIONS`` let the benchmarks compare the kernels; a compile failure falls back to eager, once, with
a warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from offload.dequantize_on_arrival import DequantizedParamOffloader

log = logging.getLogger(__name__)


@functools.cache
def _kernels() -> tuple[Callable[..., None], Callable[..., None]]:
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

    def dequantize_all_into(outs: list[torch.Tensor], inners: list[dict[str, torch.Tensor]], metas: tuple) -> None:
        for out, inner, (shape, dtype, blocks) in zip(outs, inners, metas, strict=True):
            out.copy_(NF4Parts(inner, shape, dtype, blocks).get_original_weight())

    def dequantize_spans_into(rooms: torch.Tensor, payloads: tuple[torch.Tensor, ...], weights: tuple) -> None:
        for at, parts, (shape, dtype, blocks) in weights:
            inner = {name: payloads[i][o : o + n].view(size) for name, i, o, n, size in parts}
            out = rooms[at : at + shape.numel()].view(shape)
            out.copy_(NF4Parts(inner, shape, dtype, blocks).get_original_weight())

    return dequantize_all_into, dequantize_spans_into


def _eager() -> Callable[..., None]:
    """torchao's dequantization over lists of rooms and inner tensors: ``(outs, inners, metas)``."""
    return _kernels()[0]


def _eager_spans() -> Callable[..., None]:
    """The same over a slot's buffers: ``(rooms, payloads viewed as each dtype, weights)`` (``ArrivalBatch``)."""
    return _kernels()[1]


@functools.cache
def _compiled(spans: bool = False) -> Callable[..., None]:
    # One graph per unit signature (dynamic=False: the weights' shapes and places in the slot, the same for
    # every block of a stack), so a block's six weights are one call: dynamo's guards and the wrappers run
    # once per unit visit, not once per weight (each call costs ~80-100 us of host time on a step the host
    # bounds). With ``spans`` the graph's inputs are just the slot's two buffers, whatever the number of
    # weights: lists of views would each be guarded, and many mutated views of one buffer make AOTAutograd
    # regenerate them from a synthetic base in Python on every call. The copies into the rooms stay in the
    # graph, so the kernels write them directly. emulate_precision_casts rounds each intermediate as eager
    # does: torchao's values, bit for bit.
    kernel = _eager_spans() if spans else _eager()
    return torch.compile(kernel, fullgraph=True, dynamic=False, options=dict(COMPILE_OPTIONS))


COMPILE_ON_CUDA = True  # bench/optimizer_quant_bench.py measures both kernels
COMPILE_ON_CPU = False  # only to account the compiled path's host time on the CPU (bench/nf4_arrival_host_cpu.py)
COMPILE_OPTIONS = {"emulate_precision_casts": True}
_COMPILE_FAILED: list[BaseException] = []

NF4Meta = tuple[torch.Size, torch.dtype, tuple[int, int]]  # a weight's shape, dtype, block and scaler block sizes


def dequantize_nf4_all_into(
    outs: list[torch.Tensor], inners: list[dict[str, torch.Tensor]], metas: tuple[NF4Meta, ...]
) -> None:
    """Write torchao's dequantization of each NF4 payload ``inners[i]`` (its inner tensors by name; ``metas[i]``:
    its shape, dtype, block and scaler block sizes) into ``outs[i]``, on the current stream, in one call: one
    compiled graph on CUDA, torchao's eager ops elsewhere (or if compiling fails, with a warning, once)."""
    _run(outs[0].device.type, spans=False, args=(outs, inners, metas))


def _run(device: str, *, spans: bool, args: tuple) -> None:
    """One dequantization call: compiled where asked for (until a compile fails), else torchao's eager ops."""
    with torch.no_grad():
        if ((device == "cuda" and COMPILE_ON_CUDA) or (device == "cpu" and COMPILE_ON_CPU)) and not _COMPILE_FAILED:
            try:
                # The same cache keys as the callers before (the benchmark reads ``_compiled()`` as the engine's).
                (_compiled(spans=True) if spans else _compiled())(*args)
                return
            except Exception as error:  # any compiler failure: the eager path writes the same values
                _COMPILE_FAILED.append(error)
                log.warning("NF4 dequantization on arrival runs eagerly (torch.compile failed: %r)", error)
        (_eager_spans() if spans else _eager())(*args)


def dequantize_nf4_into(
    out: torch.Tensor, inner: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype, blocks: tuple[int, int]
) -> None:
    """``dequantize_nf4_all_into`` for one weight."""
    dequantize_nf4_all_into([out], [inner], ((shape, dtype, blocks),))


NF4Part = tuple[str, int, int, int, torch.Size]  # an inner tensor: name, its dtype's index, offset, numel, shape
# The payloads' dtypes, and per weight: its room offset (elements), its inner tensors, its meta.
SpanLayout = tuple[tuple[torch.dtype, ...], tuple[tuple[int, tuple[NF4Part, ...], NF4Meta], ...]]


def span_layout(weights: list[DequantizedParamOffloader]) -> SpanLayout:
    """Where ``weights`` (of one ring slot) lie in the slot and its room: ``dequantize_nf4_spans_into``'s layout.
    Offsets are in elements of each inner tensor's dtype, so the graph reads typed views of the slot and
    casts no bytes itself (a dtype view inside the graph is an op of its own per inner tensor, per call)."""
    dtypes: list[torch.dtype] = []
    laid = []
    for weight in weights:
        parts = []
        for name, at, nbytes, shape, dtype in weight.payload.layout:
            if dtype not in dtypes:
                dtypes.append(dtype)
            offset = weight.slot_offset + at
            assert offset % dtype.itemsize == 0  # the arena's and the plan's alignment
            parts.append((name, dtypes.index(dtype), offset // dtype.itemsize, nbytes // dtype.itemsize, shape))
        laid.append((weight.room_offset // weight.like.dtype.itemsize, tuple(parts), weight.meta))
    return tuple(dtypes), tuple(laid)


def dequantize_nf4_spans_into(rooms: torch.Tensor, payloads: torch.Tensor, layout: SpanLayout) -> None:
    """``dequantize_nf4_all_into`` for weights laid out in two buffers: ``payloads`` (a ring slot's bytes,
    ``uint8``) holds each weight's inner tensors where ``layout`` says, and its dequantized form goes into
    ``rooms`` (the slot's room, viewed as the weights' dtype) at its element offset."""
    dtypes, weights = layout
    typed = tuple(payloads.view(dtype) for dtype in dtypes)
    _run(rooms.device.type, spans=True, args=(rooms, typed, weights))
