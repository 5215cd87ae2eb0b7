"""A frozen int8 linear layer (torchao's ``Int8Tensor``, one scale per output row) whose weight is
dequantized in one pass.

torchao's weight-only int8 linear converts the int8 codes to the activation's dtype (a kernel that reads one
byte and writes two per weight, and runs far below the device's bandwidth), multiplies the matmul's output by
the row scales (a second pass, over the output), and lets autograd save the converted weight for backward,
whose gradient takes a third pass through the scales. A LoRA step with checkpointing runs a frozen linear
three times (forward, recompute, backward): on Flux.2-dev's shape that is 0.30 s of a 2.5 s step spent in
those conversions and scalings (a profiler trace, bench/diffusion_profile.py, against the resident bf16 step).

``Int8Linear`` computes the weight instead as torchao's own ``Int8Tensor.dequantize`` does (codes minus zero
point, times the row scale in float32, rounded to the activation's dtype) in one pass that reads the codes
once and writes the weight once: on CUDA a Triton kernel, elsewhere torchao's eager ops. The weight then goes through a plain ``F.linear`` (the bias fused into the matmul). Only the int8
parameter is saved for backward, never the dequantized weight, so the offload engine sees the parameter among
the saved tensors (it keeps or brings it back for backward) and the backward dequantizes it again: one more
pass instead of a saved copy of every linear of a recomputed block.

``quantize_frozen_weights(model, "int8")`` gives every quantized ``nn.Linear`` this class, in place (same
object, parameters, hooks and state dict), so resident and offloaded training run the same code.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def is_int8(tensor: torch.Tensor) -> bool:
    """torchao's ``Int8Tensor`` (checked by name: torchao is imported only when quantizing)."""
    return type(tensor).__name__ == "Int8Tensor" and type(tensor).__module__.startswith("torchao.")


def weight_from_codes(
    qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """torchao's ``dequantize_affine`` for int8 codes with one scale (and zero point) per row, over plain
    tensors: the codes in ``dtype`` (exact: int8 values and their differences are integers bf16 holds), minus
    the zero point, times the float32 scale, rounded to ``dtype``."""
    codes = qdata.to(dtype)
    if zero_point is not None:
        codes = codes - zero_point.view(-1, 1).to(dtype)
    return (codes * scale.view(-1, 1)).to(dtype)


@functools.cache
def _row_kernel() -> Any:
    """A Triton kernel for :func:`weight_from_codes`: one program per row and block of columns, so a row's
    scale is read once and no element index is divided by the row length (``torch.compile`` of the same two
    lines, its sizes dynamic to serve a model's many projection shapes, ran at a quarter of the device's
    bandwidth: 0.38 ms for a 55296 x 6144 weight on an H200)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dequantize_rows(codes, scales, zeros, out, columns, BLOCK: tl.constexpr, ZERO: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < columns
        values = tl.load(codes + row * columns + offsets, mask=inside, other=0).to(tl.float32)
        if ZERO:
            values = values - tl.load(zeros + row).to(tl.float32)
        values = values * tl.load(scales + row)  # float32, rounded once to the output's dtype below
        tl.store(out + row * columns + offsets, values.to(out.dtype.element_ty), mask=inside)

    return dequantize_rows


_BLOCK = 2048  # columns per program: 16 codes per thread of 4 warps, read as one 16-byte load
_KERNEL_FAILED: list[BaseException] = []
_KERNEL_DEVICE = "cuda"  # where the Triton kernel runs


def _kernel_applies(qdata: torch.Tensor) -> bool:
    """Whether the Triton kernel dequantizes ``qdata``: on CUDA, contiguous codes, the kernel not failed before,
    and not while ``torch.compile`` traces the layer. Dynamo cannot trace the kernel's way in (the JIT decorator
    under ``functools.cache``, the ``try`` around its launch): it would break the compiled block's graph at
    every int8 linear, and each break restarts dynamo's analysis, whose dropped attempt leaves weak references
    on the weights that keep the engine from swapping them (offload/quant/swap.py). Traced, torchao's eager
    lines below are one fused kernel of inductor's."""
    on_device = qdata.device.type == _KERNEL_DEVICE and qdata.is_contiguous()
    return on_device and not _KERNEL_FAILED and not torch.compiler.is_compiling()


def _dequantize_on_device(
    qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    rows, columns = qdata.shape
    out = torch.empty((rows, columns), dtype=dtype, device=qdata.device)
    scales = scale.reshape(-1)
    zeros = zero_point.reshape(-1) if zero_point is not None else scales  # (not read without a zero point)
    grid = (rows, (columns + _BLOCK - 1) // _BLOCK)
    _row_kernel()[grid](qdata, scales, zeros, out, columns, BLOCK=_BLOCK, ZERO=zero_point is not None)
    return out


def dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int8 ``weight`` as a ``dtype`` tensor, equal bit for bit to ``weight.dequantize(dtype)``: the
    Triton kernel on CUDA, torchao's ops elsewhere, inside a compiled region and where the kernel fails (e.g.
    without Triton: then with a warning, once)."""
    parts = (weight.qdata, weight.scale, weight.zero_point, dtype)  # type: ignore[attr-defined]
    if _kernel_applies(parts[0]):
        try:
            return _dequantize_on_device(*parts)
        except Exception as error:  # any Triton failure: the eager path computes the same weight
            _KERNEL_FAILED.append(error)
            log.warning("int8 dequantization runs eagerly (its Triton kernel failed: %r)", error)
    return weight_from_codes(*parts)


def _compute_dtype(input: torch.Tensor) -> torch.dtype:
    """The dtype the matmul runs in: autocast's where it is on (so no float32 weight is made only to be cast
    down), else the input's."""
    device = input.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return input.dtype


class _LinearInt8(torch.autograd.Function):
    """``F.linear`` over the dequantized int8 weight, which exists only inside each call."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)  # the int8 parameter (half the bytes), not its dequantized form
        ctx.bias_shape = None if bias is None else bias.shape
        return F.linear(input, dequantize(weight, _compute_dtype(input)), bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        (weight,) = ctx.saved_tensors
        grad_input = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output @ dequantize(weight, grad_output.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0).reshape(ctx.bias_shape)
        return grad_input, None, grad_bias  # the frozen weight gets no gradient


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is torchao's per-row ``Int8Tensor``, dequantized in one pass per
    call (the module docstring says why); any other weight computes as ``nn.Linear`` does."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not is_int8(weight) or list(weight.block_size) != [1, weight.shape[-1]]:  # type: ignore[attr-defined]
            return F.linear(input, weight, self.bias)  # e.g. per-group scales: torchao's own linear
        return _LinearInt8.apply(input, weight, self.bias)
