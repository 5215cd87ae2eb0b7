"""torchao's NF4 dequantization run over a payload's plain inner tensors, written into device buffers: the
kernels that ``dequantize_on_arrival.py`` calls right after a unit's NF4 payloads reach its ring slot.

The arithmetic is torchao's own (``NF4Tensor.dequantize`` for the 4-bit codes, ``dequantize_scalers`` for the
double-quantized block scales, the same bf16 multiply), run over plain tensors rather than the tensor
subclass: eagerly, or on CUDA traced by ``torch.compile`` into one graph per unit layout, with no subclass
guards to run per call. Only where each value goes is written differently from ``get_original_weight``: that
interleaves the high and low nibbles' values with ``torch.stack``, which inductor materializes into a
temporary and then copies (two passes over the weight, the second with strided reads); here each output
element picks its own nibble by index, so the whole weight is one pointwise kernel that reads the codes
once and writes its room once. The values
are torchao's bit for bit (tests/offload/quant/test_quantized.py and test_dequantize_on_arrival.py compare them
with ``NF4Tensor.get_original_weight``). ``COMPILE_ON_CUDA``, ``COMPILE_ON_CPU`` and ``COMPILE_OPTIONS`` let
the benchmarks compare the kernels; a compile failure falls back to eager, once, with a warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from offload.arena import aligned
from offload.quant.payload import QuantizedPayload, stored_bytes

log = logging.getLogger(__name__)


@functools.cache
def _kernels() -> tuple[Callable[..., None], Callable[..., None], Callable[[torch.Tensor], torch.Tensor]]:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    class NF4Parts:
        """What torchao's ``NF4Tensor.get_original_weight`` reads, as plain attributes: torchao's dequantization
        methods then run over plain tensors (eager, or traced by torch.compile without the subclass)."""

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

        def weight(self) -> torch.Tensor:
            """``get_original_weight``'s values, each element computed where it lands (module docstring)."""
            codes = self.quantized_data.unsqueeze(-1).expand(-1, 2)  # byte i holds elements 2i (high) and 2i+1
            low = torch.arange(2, device=codes.device).expand(codes.shape) == 1
            codes = torch.where(low, codes & 0b1111, codes >> 4).to(torch.long).reshape(-1)
            values = self.dequantize(codes, self.nf4)
            scalers = self.dequantize_scalers(self.quantized_scalers, self.quantization_factor, self.scaler_block_size)
            repeated = scalers.unsqueeze(-1).expand(scalers.size(0), self.block_size).reshape(-1)
            return (values * repeated).reshape(self.shape)

    def dequantize_all_into(outs: list[torch.Tensor], inners: list[dict[str, torch.Tensor]], metas: tuple) -> None:
        for out, inner, (shape, dtype, blocks) in zip(outs, inners, metas, strict=True):
            out.copy_(NF4Parts(inner, shape, dtype, blocks).weight())

    def dequantize_spans_into(
        rooms: tuple[torch.Tensor, ...], payloads: tuple[torch.Tensor, ...], weights: tuple
    ) -> None:
        # Each weight's room is an input of its own (flat, non-overlapping views of the slot's room): written
        # as views of one room tensor, the six copies would be functionalized into a chain of slice_scatters
        # that inductor lowers to one kernel over the whole room, every element evaluating all six branches.
        for room, (parts, (shape, dtype, blocks)) in zip(rooms, weights, strict=True):
            inner = {name: payloads[i][o : o + n].view(size) for name, i, o, n, size in parts}
            room.view(shape).copy_(NF4Parts(inner, shape, dtype, blocks).weight())

    def weight_of(tensor: torch.Tensor) -> torch.Tensor:
        blocks = (tensor.block_size, tensor.scaler_block_size)  # type: ignore[attr-defined]
        inner = {name: getattr(tensor, name) for name in NF4_INNER}
        return NF4Parts(inner, tensor.shape, tensor.dtype, blocks).weight()

    return dequantize_all_into, dequantize_spans_into, weight_of


def nf4_weight_function() -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of an NF4 tensor giving torchao's ``get_original_weight()`` values, computed as this module's
    kernels compute them (one pointwise pass). Traceable by ``torch.compile`` with the NF4 tensor as input;
    get it outside the compiled function (dynamo would trace the cached builder and its class body)."""
    return _kernels()[2]


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
    # once per unit visit, not once per weight (each call is host time, on a step the host bounds). With
    # ``spans`` the payloads are the slot's buffer (viewed once per dtype), whatever the number of weights,
    # and the rooms one flat view per weight, made once per slot: views that do not overlap, so AOTAutograd
    # needs no synthetic base for them. The copies into the rooms stay in the graph, so the kernels write
    # them directly. emulate_precision_casts rounds each intermediate as eager does: torchao's values, bit
    # for bit.
    kernel = _eager_spans() if spans else _eager()
    return torch.compile(kernel, fullgraph=True, dynamic=False, options=dict(COMPILE_OPTIONS))


COMPILE_ON_CUDA = True  # bench/optimizer_quant_bench.py measures both kernels
COMPILE_ON_CPU = False  # only to account the compiled path's host time on the CPU (bench/nf4_arrival_host_cpu.py)
COMPILE_OPTIONS = {"emulate_precision_casts": True}
_COMPILE_FAILED: list[BaseException] = []

# NF4Tensor's inner tensors (its ``__tensor_flatten__`` names, spelled out: dynamo traces attribute reads).
NF4_INNER = ("quantized_scalers", "quantization_factor", "quantized_data", "nf4", "scaler_mean")
NF4Meta = tuple[torch.Size, torch.dtype, tuple[int, int]]  # a weight's shape, dtype, block and scaler block sizes


def dequantize_nf4_all_into(
    outs: list[torch.Tensor], inners: list[dict[str, torch.Tensor]], metas: tuple[NF4Meta, ...]
) -> None:
    """Write torchao's dequantization of each NF4 payload ``inners[i]`` (its inner tensors by name; ``metas[i]``:
    its shape, dtype, block and scaler block sizes) into ``outs[i]``, on the current stream, in one call: one
    compiled graph on CUDA, torchao's eager ops elsewhere (or if compiling fails, with a warning, once)."""
    _run(outs[0].device.type, spans=False, args=(outs, inners, metas))


def _compiles(device: str) -> bool:
    """Whether a call on ``device`` runs the compiled kernel: where asked for, until a compile fails."""
    return ((device == "cuda" and COMPILE_ON_CUDA) or (device == "cpu" and COMPILE_ON_CPU)) and not _COMPILE_FAILED


def _run(device: str, *, spans: bool, args: tuple) -> None:
    """One dequantization call: compiled where asked for (until a compile fails), else torchao's eager ops."""
    with torch.no_grad():
        if _compiles(device):
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
# The payloads' dtypes, and per weight: its inner tensors and its meta (its room is passed beside the layout).
SpanLayout = tuple[tuple[torch.dtype, ...], tuple[tuple[tuple[NF4Part, ...], NF4Meta], ...]]


class PlacedNF4(Protocol):
    """An NF4 weight's payload at ``slot_offset`` of a slot, as ``span_layout`` reads it: a
    ``DequantizedParamOffloader`` (dequantize_on_arrival.py) or a ``PackedNF4`` (no engine)."""

    @property
    def payload(self) -> QuantizedPayload: ...

    @property
    def slot_offset(self) -> int: ...

    @property
    def meta(self) -> NF4Meta: ...


def span_layout(weights: Sequence[PlacedNF4]) -> SpanLayout:
    """Where ``weights`` (of one ring slot) lie in the slot: ``dequantize_nf4_spans_into``'s layout.
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
        laid.append((tuple(parts), weight.meta))
    return tuple(dtypes), tuple(laid)


@dataclass(frozen=True)
class PackedNF4:
    """An NF4 weight's payload packed at ``slot_offset`` of a buffer, without an engine: what ``span_layout``
    reads of a ``DequantizedParamOffloader``."""

    payload: QuantizedPayload
    slot_offset: int
    meta: NF4Meta


def pack_nf4_into(slot: torch.Tensor, nf4s: list[torch.Tensor]) -> SpanLayout:
    """Pack ``nf4s``' payloads into ``slot`` one after another, each aligned, as the ring lays out a unit's NF4
    weights, and return their layout: a unit's dequantization without an engine (benchmarks, tests)."""
    packed, at = [], 0
    for nf4 in nf4s:
        nbytes = stored_bytes(nf4)
        meta = (nf4.shape, nf4.dtype, (nf4.block_size, nf4.scaler_block_size))  # type: ignore[attr-defined]
        packed.append(PackedNF4(QuantizedPayload(nf4, slot[at : at + nbytes]), at, meta))
        at += aligned(nbytes)
    return span_layout(packed)


def dequantize_nf4_spans_into(
    rooms: tuple[torch.Tensor, ...], payloads: torch.Tensor, layout: SpanLayout, graphs: bool = True
) -> None:
    """``dequantize_nf4_all_into`` for weights laid out in a slot: ``payloads`` (a ring slot's bytes, ``uint8``)
    holds each weight's inner tensors where ``layout`` says, and its dequantized form goes into its room,
    ``rooms[i]`` (a flat view of the slot's room at the weight's offset). On CUDA, a slot seen before replays
    the call's CUDA graph (``SlotGraphs``), unless ``graphs`` is False (buffers that do not recur)."""
    graphed = graphs and payloads.device.type == "cuda" and GRAPHS_ON_CUDA and _compiles("cuda")
    if graphed and _SLOT_GRAPHS.replay(rooms, payloads, layout):
        return
    dtypes, weights = layout
    typed = tuple(payloads.view(dtype) for dtype in dtypes)
    _run(payloads.device.type, spans=True, args=(rooms, typed, weights))


class SlotGraphs:
    """A unit's dequantization replayed as a CUDA graph: one launch per block visit instead of a Python call.

    The compiled call is still a Python call: dynamo's guards, inductor's wrapper and one Triton launch per
    weight, all host time, where a replay is a single launch. A step the GPU bounds does not gain from it; one
    the host bounds does. Its inputs and outputs are a ring slot's payloads and room, whose addresses recur
    every step (a unit lands in one of a few slots), so the call is captured once per (slot, layout) and
    replayed after, on the current stream (the copy stream: ordered after the copy, as the call was). The
    graph reads the payloads and writes the rooms at those addresses, so it stays valid while the buffers
    there keep that layout: a ring re-made at the same addresses has it, one re-made elsewhere gets graphs of
    its own. A slot's first call is the compiled call itself (it may compile, and autotuning synchronizes),
    its second is captured. Capture is ``thread_local``: a loader thread pinning memory meanwhile does not
    invalidate it. A capture that fails turns graphs off, once, with a warning; the compiled call writes the
    same values. (A capture that fails after it began may leave torch's CUDA RNG in capture mode, which fails
    later random ops: not expected of these pointwise kernels, which neither synchronize nor allocate.)
    """

    MAX_GRAPHS = 32  # a ring has prefetch + 1 slots, and a model a few unit layouts

    def __init__(self) -> None:
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._called: set[tuple] = set()  # keys the compiled call has run for (compiled and tuned)
        self.failed: list[BaseException] = []
        self.captures = 0
        self.replays = 0

    def replay(self, rooms: tuple[torch.Tensor, ...], payloads: torch.Tensor, layout: SpanLayout) -> bool:
        """Replay (capturing first if need be) the call for these buffers; False: make the call instead."""
        if self.failed:
            return False
        key = (payloads.data_ptr(), tuple(room.data_ptr() for room in rooms), layout)
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._called:  # the first call may compile and autotune (it syncs): not under capture
                if len(self._called) >= self.MAX_GRAPHS:
                    self._called.clear()
                self._called.add(key)
                return False
            graph = self._capture(rooms, payloads, layout)
            if graph is None:
                return False
            if len(self._graphs) >= self.MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = graph
        graph.replay()
        self.replays += 1
        return True

    def _capture(
        self, rooms: tuple[torch.Tensor, ...], payloads: torch.Tensor, layout: SpanLayout
    ) -> torch.cuda.CUDAGraph | None:
        # Capture needs a side stream (the engine's copy stream); on the default stream torch refuses, and some
        # versions refuse only after putting the CUDA RNG into capture mode, which then fails every later
        # random op. So the compute stream (a unit onloaded without prefetch) makes the compiled call.
        if torch.cuda.current_stream(payloads.device) == torch.cuda.default_stream(payloads.device):
            return None
        dtypes, weights = layout
        typed = tuple(payloads.view(dtype) for dtype in dtypes)
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end, not torch.cuda.graph(): that synchronizes the device, collects garbage and empties
        # the allocator's cache on entry, none of which a capture of kernels over fixed buffers needs.
        try:
            with torch.no_grad():
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    _compiled(spans=True)(rooms, typed, weights)
                finally:
                    graph.capture_end()
        except Exception as error:  # e.g. a kernel that synchronizes: the plain call writes the same values
            self.failed.append(error)
            log.warning("NF4 dequantization on arrival runs without CUDA graphs (capture failed: %r)", error)
            return None
        self.captures += 1
        return graph

    def clear(self) -> None:
        """Forget every graph (``forget_compiled_kernels`` does, with the compiled kernels they replay)."""
        self._graphs.clear()
        self._called.clear()


GRAPHS_ON_CUDA = True  # bench/optimizer_quant_bench.py measures with and without
_SLOT_GRAPHS = SlotGraphs()


def forget_compiled_kernels() -> None:
    """Compile the dequantization afresh at its next call (after a change to ``COMPILE_OPTIONS``), and forget
    the slots' graphs with it: they replay the kernels compiled when they were captured."""
    _compiled.cache_clear()
    _SLOT_GRAPHS.clear()
