"""``model.quantize`` with model offload: the frozen base quantized layer by layer as it loads.

The model is built on the meta device as for the bf16 path (weight_sources.py); its frozen linear weights
become quantized placeholders (``offload.quantized_placeholders``) whose pinned host copies are the quantized
payload. `QuantizingSource` wraps the model's own source: the engine's fill of a placeholder reads (or draws)
that one weight, quantizes it on the job's GPU (else the CPU) and writes the payload
(``offload.QuantizingFill``); every other tensor is filled as before. The bf16 model never exists whole in
host or device memory: at most one dense weight per loader thread does.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from jobs.models.loading.weight_sources import LoadReport, WeightSource
from offload.disk import FileRange


class QuantizingSource(WeightSource):
    """``source``'s values, the frozen linear weights of ``model`` (meta) quantized with ``method`` as they load.

    Args:
        source: the model's weight source (checkpoint, random, seeded init), made for ``model`` before this.
        model: the meta model, adapters added; its frozen ``nn.Linear`` weights are replaced by placeholders.
        method: ``"nf4"`` or ``"int8"``.
        device: where to quantize (the job's device: a GPU quantizes billions of weights in seconds).

    Example:
        >>> model, source = family.build_on_meta(spec.model, seed, device)
        >>> source = QuantizingSource(source, model, "nf4", device)
        >>> OffloadTrainingManager(model, device, initialize=source.fill)
    """

    def __init__(self, source: WeightSource, model: nn.Module, method: str, device: torch.device) -> None:
        from offload.quant.on_load import QuantizingFill, quantized_placeholders  # torchao: an optional extra

        self.source = source
        self.method = method
        self.kind = source.kind
        self.names, self.index = source.names, source.index
        self.bytes = 0
        self._started = time.perf_counter()
        self.placeholders = quantized_placeholders(model, method)
        where = device if device.type == "cuda" else torch.device("cpu")
        self.quantizing = QuantizingFill(source.fill, source.dense, self.placeholders, method, where, source.submit)

    def fill(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.quantizing(name, tensor, host)

    def file_range(self, name: str, tensor: torch.Tensor) -> FileRange | None:
        """The unquantized tensors' ranges; a quantized weight's stored form is not the file's bytes (the
        engine keeps it in RAM)."""
        return self.source.file_range(name, tensor)

    def finish(self) -> LoadReport:
        report = self.source.finish()  # waits for every read, draw and quantization
        return LoadReport(
            source=report.source,
            bytes=report.bytes,
            seconds=time.perf_counter() - self._started,
            quantized=self.method,
            stored_bytes=self.quantizing.stored_bytes,
            quantize_seconds=self.quantizing.quantize_seconds,
        )
