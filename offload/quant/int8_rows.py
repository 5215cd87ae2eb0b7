"""Frozen int8 weights, one scale per output row (torchao's ``Int8Tensor`` weight-only layout): the weight the
layer computes with, and the one kernel that makes it.

torchao's own int8 weight-only ``F.linear`` casts the codes to the activation's dtype inside every call, runs
the matmul, and scales the output rows: with gradient checkpointing three casts of every weight a step, on the
compute stream, with a saved bf16 copy of each weight for the backward. A weight the engine streams arrives on
the copy stream anyway, so, as for NF4 (dequantize_on_arrival.py), the engine writes its dequantized form once
per visit into room beside its ring slot, on the copy stream, and the layer runs a plain matmul.

The dequantized weight is ``codes x scale`` rounded once to the weight's dtype: ``Int8Tensor.dequantize()``'s
values bit for bit for the symmetric weights Ferry quantizes (their zero points are 0; torchao's int8
weight-only linear ignores zero points too). It is not torchao's linear bit for bit: that one rounds the
unscaled product and the bf16 scale before it multiplies. Measured against the exact product of the int8
weight (tests/offload/quant/test_int8_rows.py), the dequantized weight's output is as close or closer.
Training offloaded equals training resident bit for bit because every layer with such a weight is an
``Int8Linear`` (``quantize_frozen_weights`` gives it the class), which computes with the same dequantized
weight whether the weight is torchao's tensor (resident; dequantized in the call by the same kernel) or the
plain tensor the engine dequantized it into on arrival.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def is_int8_rows(tensor: torch.Tensor) -> bool:
    """torchao's ``Int8Tensor`` with one scale per output row and no activation quantization (weight-only):
    the form ``quantize_frozen_weights(..., "int8")`` gives (checked by name: torchao is imported only when
    quantizing)."""
    if type(tensor).__name__ != "Int8Tensor" or not type(tensor).__module__.startswith("torchao."):
        return False
    block = list(getattr(tensor, "block_size", []))
    return (
        tensor.dim() == 2
        and block == [1, tensor.shape[-1]]
        and getattr(tensor, "act_quant_kwargs", None) is None
        and getattr(tensor, "act_pre_scale", None) is None
    )


def dequantize_int8_rows_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Write ``codes x scale`` (int8 codes ``[rows, columns]``, float32 scales ``[rows, 1]``) into ``out`` (the
    weight's dtype and shape): one pointwise kernel that reads the codes once and writes the weight once, the
    product computed in float32 and rounded once, as ``Int8Tensor.dequantize()`` computes it."""
    torch.mul(codes, scale, out=out)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """An ``Int8Tensor`` weight (per-row) as a plain tensor of its own dtype (``dequantize_int8_rows_into``)."""
    out = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    dequantize_int8_rows_into(out, weight.qdata, weight.scale)  # type: ignore[attr-defined]
    return out


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is torchao's per-row ``Int8Tensor``, computing with the dequantized
    weight whatever form it is in when the layer runs: the ``Int8Tensor`` (dequantized here, in the call) or
    the plain tensor the offload engine dequantized it into on arrival (the same values). Either way the
    matmul, its bias and its backward are a plain ``F.linear``'s. ``quantize_frozen_weights(model, "int8")``
    gives int8 linears this class, in place (same object, parameters, hooks and state dict)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if is_int8_rows(weight):
            weight = dequantized(weight)
        return F.linear(input, weight, self.bias)
