"""Frozen weights stored, streamed and kept quantized (QLoRA style), with torchao's tensors.

``quantize_frozen_weights(model, "nf4" | "int8")`` replaces every frozen ``nn.Linear`` weight with torchao's
``NF4Tensor`` (4-bit NormalFloat with double-quantized block scales, as QLoRA) or ``Int8Tensor`` (int8 per
output channel). The model then trains as it would resident on a device: the weight is dequantized inside
each linear's forward and backward (an int8 linear becomes ``Int8Linear``, int8_linear.py, which does it in
one pass). Nothing here writes its own quantizer. With
``compile_dequantization=True`` an NF4 ``nn.Linear`` becomes ``CompiledNF4Linear`` (nf4_linear.py), which on a
GPU runs torchao's dequantization compiled into one kernel.

The engine keeps such a weight quantized everywhere: its inner tensors (codes, scales) are packed into one
``uint8`` payload in the pinned arena (``QuantizedPayload``, payload.py; ``QuantizedParamOffloader``), that
payload is what crosses the link (the memory plan sizes ring slots from ``stored_bytes``), and on the device
the parameter becomes the same torchao tensor over views of the copied payload, so dequantization happens on
the device, inside the layer.
A streamed NF4 weight is by default dequantized once on arrival instead (dequantize_on_arrival.py) and
computes as a plain tensor. Since host and device run the same torchao code on the same codes, quantized +
offloaded training equals quantized resident training (bitwise on the CPU).

torchao is an optional dependency (``pip install ferry[quantize]``); it is imported only when quantizing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from offload.arena import aligned
from offload.offloaders import StaticParamOffloader, TensorOffloader
from offload.quant.int8_linear import Int8Linear
from offload.quant.nf4_linear import CompiledNF4Linear, NF4Linear
from offload.quant.payload import QuantizedPayload, is_quantized, stored_bytes
from offload.quant.swap import require_swappable, swappable
from offload.ring import copy_into_ring
from offload.transfers import CopyEngine, PendingCopy

log = logging.getLogger(__name__)
METHODS = ("nf4", "int8")
NF4_BLOCK = 64  # QLoRA's block size: one absmax scale per 64 weights
NF4_SCALER_BLOCK = 256  # the scales are themselves quantized in blocks of 256


def quantizable(module: nn.Module, method: str, *, shapes_only: bool = False) -> bool:
    """A frozen ``nn.Linear`` whose weight torchao can quantize with ``method`` (NF4 needs whole blocks);
    ``shapes_only``: judge a meta-device weight by its shape and dtype (a job's estimate at submit time)."""
    if not isinstance(module, nn.Linear) or is_quantized(module.weight) or module.weight.requires_grad:
        return False
    if not module.weight.dtype.is_floating_point or (module.weight.is_meta and not shapes_only):
        return False
    if method == "nf4":
        return module.weight.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK) == 0
    return True


def planned_sizes(model: nn.Module, method: str, *, dequantize_on_arrival: bool = True) -> dict[str, Any]:
    """``plan_memory``'s ``link_bytes`` and ``room_bytes`` for ``model`` (e.g. built on the meta device) as the
    engine will plan it once ``quantize_frozen_weights(model, method)`` has run: each weight it will quantize
    takes torchao's stored bytes (``stored_bytes_after``) and, NF4 dequantized on arrival, room for its
    dequantized form."""
    targets = {id(m.weight) for m in model.modules() if quantizable(m, method, shapes_only=True)}

    def link(name: str, tensor: torch.Tensor) -> int:
        return stored_bytes_after(tensor, method) if id(tensor) in targets else stored_bytes(tensor)

    def room(name: str, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size() if id(tensor) in targets else 0

    arrival = dequantize_on_arrival and method == "nf4"
    return {"link_bytes": link, "room_bytes": room if arrival else None}


def stored_bytes_after(weight: torch.Tensor, method: str) -> int:
    """``stored_bytes`` of ``weight`` once quantized with ``method``, from its shape alone: torchao's layouts
    (NF4: 4-bit codes, an int8 scale per 64, a scale factor per 256 scales, their mean and the 16-value table;
    int8: int8 codes, a float32 scale and an int8 zero point per row). tests/offload/quant/test_quantized.py checks
    it against the real tensors."""
    numel, size = weight.numel(), weight.element_size()
    if method == "nf4":
        parts = [numel // 2, size, numel // (NF4_BLOCK * NF4_SCALER_BLOCK) * size, numel // NF4_BLOCK, 16 * size]
    else:
        rows = weight.shape[0]
        parts = [numel, rows * 4, rows]
    return sum(aligned(n) for n in parts)


def quantize_frozen_weights(
    model: nn.Module, method: str, *, device: str | torch.device | None = None, compile_dequantization: bool = False
) -> list[str]:
    """Quantize every frozen ``nn.Linear`` weight of ``model`` in place with torchao; returns their names.

    Args:
        model: any module; trainable weights (LoRA adapters, a head being trained) stay as they are.
        method: ``"nf4"`` (4-bit NormalFloat, QLoRA) or ``"int8"`` (int8 weight-only, per output channel).
        device: where to run the quantization kernels (``"cuda"`` is much faster for billions of weights);
            the quantized weights come back to the weight's own device.
        compile_dequantization: NF4 only: plain ``nn.Linear`` modules become ``CompiledNF4Linear``, whose
            GPU dequantization is one compiled kernel (faster resident; a streamed weight is dequantized on
            arrival by the engine instead). Without it, biased ones become ``NF4Linear`` (the bias added
            after the matmul, as torchao does, whatever form the weight computes in).

    Raises:
        ValueError: for an unknown ``method``, or when torchao is not installed.

    Example:
        >>> model.requires_grad_(False); add_adapters(model)
        >>> quantize_frozen_weights(model, "nf4")
    """
    if method not in METHODS:
        raise ValueError(f"quantize must be one of {', '.join(METHODS)}; got {method!r}")
    quantize = quantizer(method)
    names = []
    for name, module in model.named_modules():
        if not quantizable(module, method):
            continue
        weight = module.weight.detach()
        home = weight.device
        work = weight.to(device) if device is not None else weight
        quantized = quantize(work.contiguous())
        if quantized.device != home:
            quantized = quantized.to(home)
        set_quantized_weight(module, quantized, method, compile_dequantization=compile_dequantization)
        names.append(f"{name}.weight" if name else "weight")
    skipped = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not is_quantized(m.weight)]
    log.info("quantized %d frozen linear weights to %s (left as they are: %d)", len(names), method, len(skipped))
    return names


def set_quantized_weight(
    module: nn.Module, quantized: torch.Tensor, method: str, *, compile_dequantization: bool = False
) -> nn.Parameter:
    """Make ``quantized`` (a torchao tensor, or a meta placeholder of one) ``module``'s frozen weight."""
    module.weight = nn.Parameter(quantized, requires_grad=False)
    if method == "int8" and type(module) is nn.Linear:
        module.__class__ = Int8Linear  # in place, as below: one dequantization pass per call (int8_linear.py)
    if method == "nf4" and type(module) is nn.Linear and (compile_dequantization or module.bias is not None):
        # In place (not a new module): peft, hooks and optimizers keep referring to this object. A biased
        # layer adds its bias as torchao does also when its weight is dequantized on arrival (nf4_linear.py).
        module.__class__ = CompiledNF4Linear if compile_dequantization else NF4Linear
    return module.weight


def quantizer(method: str) -> Any:
    """torchao's quantization for ``method``: a function from a dense weight to its quantized tensor (which
    works on the meta device too: a placeholder with the inner tensors' shapes and dtypes)."""
    try:
        from torchao.quantization import Int8Tensor, to_nf4
        from torchao.quantization.granularity import PerRow
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ValueError(
            f"quantize: {method} needs torchao (pip install 'ferry[quantize]' or pip install torchao)"
        ) from error
    if method == "nf4":
        return lambda weight: to_nf4(weight, NF4_BLOCK, NF4_SCALER_BLOCK)
    # Per output channel (one scale per row), symmetric: torchao's int8 weight-only layout.
    return lambda weight: Int8Tensor.from_hp(weight, PerRow())


class QuantizedParamOffloader(StaticParamOffloader):
    """A frozen quantized weight: its packed payload is the pinned host copy and what crosses the link.

    The parameter object stays the same (modules, peft and autograd refer to it); its contents are swapped
    (``torch.utils.swap_tensors``) between the torchao tensor over the host payload and one over the device
    copy, because a tensor subclass keeps its data in Python attributes that ``.data`` cannot replace. A
    swap first frees the weak references a ``torch.compile`` trace may have left on the parameter, which
    ``swap_tensors`` refuses, or an offload waits while a compile still holds them (swap.py).

    Rebuilding the torchao tensor over a device copy is Python work (views of each inner tensor, the
    subclass's unflatten, a new Parameter), made on every onload it is host time a resident weight never
    pays (bench/nf4_dequant_probe.py measures it), on a step the host already bounds. A copy
    into the device ring always lands at the same few addresses (its slot, one per ring turn), so the tensor
    built over each such address is kept and swapped in again; copies into allocator memory (a ring
    overflow) are rebuilt each time, since keeping them would keep that memory alive.
    """

    MAX_KEPT = 8  # device tensors kept per weight: one per ring slot it can land in (prefetch + 1 of them)

    kind = "static"  # the budget and the schedule treat it as any frozen weight

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine, buffer: torch.Tensor) -> None:
        TensorOffloader.__init__(self, name, tensor, copies)
        self.payload = QuantizedPayload(tensor, buffer)
        self.host = buffer
        self.nbytes = buffer.numel()  # stored bytes: what the device holds and the link carries
        self._holder: torch.Tensor | None = None  # the contents not in the parameter right now
        self._over_ring: dict[int, torch.Tensor] = {}  # ring address -> the tensor built over it (see above)
        self._held_bytes = 0  # device bytes the current device copy takes
        torch.utils.swap_tensors(tensor, self.payload.tensor_over(buffer))  # now over the arena payload

    def onload(self, prefetch: bool = False) -> None:
        pending, self._in_ring = copy_into_ring(self.copies, self.host, self.placement, self.slot_offset, prefetch)
        self.attach(pending)

    def attach(self, pending: PendingCopy) -> None:
        address = pending.tensor.data_ptr()
        holder = self._over_ring.get(address) if pending.planned else None
        if holder is None:
            holder = self.payload.tensor_over(pending.tensor)
            if pending.planned:
                if len(self._over_ring) >= self.MAX_KEPT:
                    self._over_ring.pop(next(iter(self._over_ring)))
                self._over_ring[address] = holder
        self._swap_in(pending, holder, self.nbytes)

    def _swap_in(self, pending: PendingCopy, holder: torch.Tensor, held_bytes: int) -> None:
        """Make the parameter the device tensor ``holder`` (which then holds the host contents till offload)."""
        require_swappable(self.tensor, holder)  # before any state changes: it may offload weights
        self.pending = pending
        self._holder = holder
        torch.utils.swap_tensors(self.tensor, holder)
        self._held_bytes = held_bytes
        self.copies.stats.hold(held_bytes)

    def ensure_resident(self) -> torch.Tensor:
        if self.pending is None:
            self.onload()
        assert self.pending is not None  # onload() set it
        self.copies.wait(self.pending)  # the payload's copy; the dequantization after it runs on this stream
        return self.tensor

    def offload(self) -> None:
        if self.pending is None:
            return
        assert self._holder is not None  # set with pending
        if not swappable(self.tensor, self._holder):
            return  # a compile still holds it (swap.py): it stays on the device until its next release
        if self.pending is None:  # the collection freed this weight's last saved token, which offloaded it
            return
        torch.utils.swap_tensors(self.tensor, self._holder)  # back to the host payload (holder: device again)
        self._holder = None
        self.pending = None
        self.copies.stats.drop(self._held_bytes)
        if self._in_ring is not None:
            self._in_ring.release(self.copies.device)
            self._in_ring = None

    def detach(self, copy: bool = True) -> None:
        self.offload()
        self._over_ring.clear()
        restored = self.payload.tensor_over(self.host, clone=copy)
        require_swappable(self.tensor, restored)
        torch.utils.swap_tensors(self.tensor, restored)
