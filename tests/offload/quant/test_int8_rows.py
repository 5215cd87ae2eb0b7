"""Per-row int8 frozen weights (int8_rows.py): the one-kernel dequantization is torchao's ``dequantize()`` bit for
bit, ``Int8Linear`` computes with it and is at least as close to the int8 weight's exact product as torchao's
own int8 linear, and every int8 linear ``quantize_frozen_weights`` makes is an ``Int8Linear``. (A streamed
int8 weight dequantized on arrival: test_dequantize_on_arrival.py; offloaded == resident: test_quantized.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao")

from offload.quant.int8_rows import Int8Linear, dequantize_int8_rows_into, dequantized, is_int8_rows
from offload.quant.quantized import quantize_frozen_weights, quantizer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 64), (256, 1024)])
def test_the_dequantization_is_torchaos_dequantize_bit_for_bit(shape: tuple[int, int], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = quantizer("int8")((torch.randn(shape) * 0.05).to(dtype))
    assert is_int8_rows(weight)
    out = torch.empty(shape, dtype=dtype)
    dequantize_int8_rows_into(out, weight.qdata, weight.scale)
    assert torch.equal(out, weight.dequantize()) and out.dtype == dtype
    assert torch.equal(dequantized(weight), out)


def test_the_layer_is_at_least_as_close_to_the_int8_weights_exact_product_as_torchaos_linear() -> None:
    """torchao's weight-only int8 linear rounds the unscaled product to bf16, then multiplies by the scale
    rounded to bf16; the dequantized weight rounds each weight once. Against the product computed in float64
    from the codes and scales, the dequantized weight's output is the closer, seed after seed."""
    for seed in range(3):
        torch.manual_seed(seed)
        layer = nn.Linear(1024, 512, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        quantize_frozen_weights(layer, "int8")
        weight = layer.weight
        x = torch.randn(64, 1024, dtype=torch.bfloat16)
        exact = x.double() @ (weight.qdata.double() * weight.scale.double()).T

        ours, torchaos = layer(x), F.linear(x, weight)  # Int8Linear; torchao's own F.linear on its tensor
        assert not torch.equal(ours, torchaos)  # two computations, not one
        assert _error(ours, exact) <= _error(torchaos, exact) < 1e-2


def _error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_quantized_int8_linears_become_int8_linear_and_compute_with_the_dequantized_weight(bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(64, 32, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    state_keys = set(layer.state_dict())
    quantize_frozen_weights(layer, "int8")
    assert type(layer) is Int8Linear and set(layer.state_dict()) == state_keys  # in place, same state dict
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(4, 32, dtype=torch.bfloat16)
    out = layer(x)
    (x_grad,) = torch.autograd.grad(out, x, grad)
    plain = dequantized(layer.weight)
    expected = F.linear(x, plain, layer.bias)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    assert torch.equal(out, expected) and torch.equal(x_grad, expected_grad)
