"""A frozen NF4 linear layer whose dequantization runs as one compiled kernel on a GPU (opt-in).

torchao's ``NF4Tensor`` dequantizes with plain PyTorch ops (nibbles unpacked to int64, a table lookup, the
double-quantized block scales, an interleave): about ten passes over the weight per call, and a LoRA step with
checkpointing dequantizes every base weight three times (forward, recompute, backward), so the NF4 step spends
much of its time there rather than in the matmuls. ``torch.compile`` of torchao's own dequantization (as
torchtune's and torchao's QLoRA recipes compile the model) fuses it into one kernel that reads the 4-bit codes
once and writes the bf16 weight once.

Only the dequantization is compiled, not the layer: the autograd function below is torchao's ``LinearNF4``
(it saves the NF4 parameter for backward, never the bf16 weight, which lives only inside each call), so the
offload engine still sees the parameter itself among the saved tensors and keeps it resident for backward.
``emulate_precision_casts`` rounds each intermediate to its dtype as eager does, so the compiled weight is
torchao's, bit for bit. On the CPU the layer is torchao's eager code, untouched.

Opt-in (``quantize_frozen_weights(..., compile_dequantization=True)``, ``CompiledNF4Linear``): compiled,
the dequantization speeds up a step whose weights are resident but slows one whose weights the engine
streams (bench/RESULTS.md has the figures). A streamed weight is dequantized once per visit by the engine
instead (dequantize_on_arrival.py), and this layer then runs a plain matmul.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offload.quant.nf4_dequantize import nf4_weight_function

log = logging.getLogger(__name__)


def is_nf4(tensor: torch.Tensor) -> bool:
    """torchao's NF4 tensor (checked by name: torchao is imported only when quantizing)."""
    return type(tensor).__name__ == "NF4Tensor" and type(tensor).__module__.startswith("torchao.")


@functools.cache
def _compiled_dequantize() -> Any:
    # torchao's values computed in one pointwise pass (nf4_dequantize.py): ``NF4Tensor.to(dtype)`` itself,
    # compiled, is two kernels, its final interleave filling a temporary that a second kernel copies out.
    weight_of = nf4_weight_function()

    def to_dtype(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return weight_of(weight).to(dtype)

    # One graph per weight shape (dynamic=False): a model has a handful of projection shapes.
    return torch.compile(to_dtype, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})


_COMPILE_FAILED: list[BaseException] = []


def dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The NF4 ``weight`` as a ``dtype`` tensor: compiled on CUDA, torchao's eager ops elsewhere (and where
    compiling fails, e.g. without Triton: then with a warning, once)."""
    if weight.device.type == "cuda" and not _COMPILE_FAILED:
        try:
            return _compiled_dequantize()(weight, dtype)
        except Exception as error:  # any compiler failure: the eager path still computes the same weight
            _COMPILE_FAILED.append(error)
            log.warning("NF4 dequantization runs eagerly (torch.compile failed: %r)", error)
    return weight.to(dtype)


class _LinearNF4(torch.autograd.Function):
    """torchao's ``LinearNF4`` with :func:`dequantize`: the bf16 weight exists only inside each call."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)  # the NF4 parameter (a quarter of the bytes), not the dequantized one
        return F.linear(input, dequantize(weight, input.dtype))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad_output @ dequantize(weight, grad_output.dtype), None  # the frozen weight gets no gradient


class NF4Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is an NF4 tensor, adding its bias after the matmul as torchao's
    ``F.linear`` does, whatever form the weight is in when it runs: the NF4 tensor (torchao's ``LinearNF4``)
    or the plain tensor the offload engine dequantized it into on arrival (dequantize_on_arrival.py), with
    the same values bit for bit. (A plain ``nn.Linear`` with a plain weight fuses the bias into the matmul,
    which rounds differently.) ``quantize_frozen_weights(model, "nf4")`` gives biased linears this class, in
    place (same object, parameters, hooks and state dict)."""

    compiled = False  # CompiledNF4Linear: the dequantization compiled into one kernel on a GPU

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.compiled and is_nf4(weight) and weight.is_cuda:
            out = _LinearNF4.apply(input, weight)
        else:
            out = F.linear(input, weight)  # NF4: torchao's LinearNF4; dequantized on arrival: the same matmul
        return out + self.bias if self.bias is not None else out


class CompiledNF4Linear(NF4Linear):
    """``NF4Linear`` whose dequantization runs as one compiled kernel on a GPU (``compile_dequantization``)."""

    compiled = True
