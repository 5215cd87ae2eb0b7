"""Quantize on load: a meta model's frozen linear weights reach the pinned arena already quantized.

``quantize_frozen_weights`` needs the model's dense weights in memory: for a 70B model that is 140 GB of bf16
in host memory before a 37 GB NF4 arena is filled. Here the model is built on the meta device as for the
bf16 path, and each frozen ``nn.Linear`` weight becomes a *quantized placeholder*
(``quantized_placeholders``): the torchao tensor (``NF4Tensor``, ``Int8Tensor``) that quantizing a meta weight
gives, whose inner tensors are meta tensors with the shapes and dtypes quantization will produce. The engine
plans and allocates its host copy like any quantized weight's, as the packed payload of those inner tensors
(``stored_bytes``, payload.py), and calls ``initialize(name, placeholder, payload)`` to fill it. A
``QuantizingFill`` is that ``initialize``: for a placeholder it asks for the weight's dense values (one
tensor, on the device that quantizes), quantizes them with torchao's own function and writes the inner
tensors into the payload; any other tensor goes to the plain fill. So at most a few dense weights exist at a
time (one per loader thread), never the model.

The payload holds the bytes ``quantize_frozen_weights`` would have given the engine for the same dense
values: the same torchao call on the same input (tests/offload/quant/test_on_load.py compares the inner
tensors and the training losses).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from offload.quant.payload import QuantizedPayload, inner_tensors, is_quantized
from offload.quant.quantized import METHODS, quantizable, quantizer, set_quantized_weight

log = logging.getLogger(__name__)

QUANTIZING_AT_ONCE = 2
Initializer = Callable[[str, torch.Tensor, torch.Tensor], None]  # (name, meta tensor, host copy to fill)
DenseValues = Callable[[str, torch.Tensor], torch.Tensor]  # (name, dense meta weight) -> its values, any device


def quantized_placeholders(
    model: nn.Module, method: str, *, compile_dequantization: bool = False
) -> dict[int, torch.Tensor]:
    """Replace every frozen meta ``nn.Linear`` weight of ``model`` with a quantized placeholder, in place.

    The modules change as ``quantize_frozen_weights`` changes them (NF4 biased layers become ``NF4Linear``).

    Returns:
        ``id(placeholder) -> the dense meta weight it replaced``: the object a weight source knows the weight
        by (its names, its seeds), so the values it gives are the ones the dense model would have had.

    Raises:
        ValueError: for an unknown ``method``, or when torchao is not installed.

    Example:
        >>> dense = quantized_placeholders(meta_model, "nf4")
        >>> manager = OffloadTrainingManager(meta_model, "cuda", initialize=QuantizingFill(fill, values, dense, "nf4"))
    """
    if method not in METHODS:
        raise ValueError(f"quantize must be one of {', '.join(METHODS)}; got {method!r}")
    quantize = quantizer(method)
    dense: dict[int, torch.Tensor] = {}
    for module in list(model.modules()):
        if not quantizable(module, method, shapes_only=True) or not module.weight.is_meta:
            continue
        original = module.weight
        assert isinstance(original, torch.Tensor)  # a Linear's weight (quantizable checked it)
        placeholder = set_quantized_weight(
            module, quantize(original.detach()), method, compile_dequantization=compile_dequantization
        )
        dense[id(placeholder)] = original
    log.info("%d frozen linear weights will be quantized to %s as they load", len(dense), method)
    return dense


class QuantizingFill:
    """The engine's ``initialize`` for a model with quantized placeholders (module docstring).

    Args:
        fill: the plain fill, for every tensor that is not a placeholder.
        dense_values: ``dense_values(name, dense_meta_weight)``: the weight's values as a new tensor
            (synchronous), on ``device`` ideally.
        placeholders: ``quantized_placeholders``' result.
        method: ``"nf4"`` or ``"int8"``.
        device: where torchao quantizes (a GPU is much faster for billions of weights).
        run: runs one weight's work (read, quantize, write); a loader's thread pool may run several at once.
            Default: at once, in the caller.
    """

    def __init__(
        self,
        fill: Initializer,
        dense_values: DenseValues,
        placeholders: dict[int, torch.Tensor],
        method: str,
        device: torch.device | str = "cpu",
        run: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.fill = fill
        self.dense_values = dense_values
        self.placeholders = placeholders
        self.quantize = quantizer(method)
        self.device = torch.device(device)
        self.run = run if run is not None else (lambda work: work())
        self.dense_bytes = 0  # dense bytes quantized
        self.stored_bytes = 0  # quantized bytes written into the arena
        self.quantize_seconds = 0.0  # time inside torchao's quantization (summed over threads)
        self._lock = threading.Lock()
        # Reads run in as many threads as the loader has; quantizations two at a time: each holds the dense
        # weight and torchao's temporaries (about twice its bytes) on the device, under the job's memory limit.
        self._quantizing = threading.Semaphore(QUANTIZING_AT_ONCE)

    def __call__(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:
        original = self.placeholders.get(id(tensor))
        if original is None:
            self.fill(name, tensor, host)
            return
        assert is_quantized(tensor) and tensor.is_meta, f"{name}: a placeholder must be a meta quantized tensor"
        self.run(lambda: self._quantize_into(name, tensor, original, host))

    def _quantize_into(self, name: str, placeholder: torch.Tensor, original: torch.Tensor, host: torch.Tensor) -> None:
        values = self.dense_values(name, original)
        with self._quantizing:
            dense = values.to(self.device).contiguous()
            del values
            started = time.perf_counter()
            quantized = self.quantize(dense)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # a sync point: the kernels' time, not launches
            seconds = time.perf_counter() - started
            del dense  # the dense weight goes before the next one is read
            expected = [(n, t.shape, t.dtype) for n, t in inner_tensors(placeholder)]
            actual = [(n, t.shape, t.dtype) for n, t in inner_tensors(quantized)]
            assert actual == expected, f"{name}: quantized to {actual}, planned as {expected}"
            QuantizedPayload(quantized, host)  # copies the inner tensors into the payload's views (device -> pinned)
        with self._lock:
            self.dense_bytes += original.numel() * original.element_size()
            self.stored_bytes += host.numel() * host.element_size()
            self.quantize_seconds += seconds
