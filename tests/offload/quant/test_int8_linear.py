"""Int8Linear: torchao's int8 weight, dequantized in one pass per call, with torchao's values; the backward
keeps the int8 parameter, never a dequantized copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao")

from offload.quant import int8_linear
from offload.quant.int8_linear import Int8Linear, dequantize, weight_from_codes
from offload.quant.quantized import quantize_frozen_weights


def int8_layer(bias: bool, device: str = "cpu") -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(96, 48, bias=bias, dtype=torch.bfloat16, device=device).requires_grad_(False)
    quantize_frozen_weights(layer, "int8")
    return layer


def test_quantizing_to_int8_makes_the_linear_an_int8_linear_in_place() -> None:
    model = nn.Sequential(nn.Linear(32, 32, dtype=torch.bfloat16), nn.Linear(32, 8, dtype=torch.bfloat16))
    model.requires_grad_(False)
    first = model[0]
    quantize_frozen_weights(model, "int8")
    assert model[0] is first and type(first) is Int8Linear
    assert list(first.state_dict()) == ["weight", "bias"]


def test_the_weight_is_torchaos_dequantized_weight_bit_for_bit() -> None:
    layer = int8_layer(bias=False)
    weight = layer.weight
    for dtype in (torch.bfloat16, torch.float32):
        expected = weight.dequantize(dtype)
        assert torch.equal(dequantize(weight, dtype), expected)
        assert torch.equal(weight_from_codes(weight.qdata, weight.scale, weight.zero_point, dtype), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_backward_are_those_of_a_linear_over_the_dequantized_weight(bias: bool) -> None:
    layer = int8_layer(bias)
    if bias:
        layer.bias.requires_grad_(True)  # a trained bias gets its gradient through the layer
    x = torch.randn(2, 5, 96, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    reference_x = x.detach().clone().requires_grad_()
    reference_bias = layer.bias.detach().clone().requires_grad_() if bias else None
    reference = F.linear(reference_x, layer.weight.dequantize(torch.bfloat16), reference_bias)
    assert torch.equal(out, reference)
    grad = torch.randn_like(out)
    out.backward(grad)
    reference.backward(grad)
    assert torch.equal(x.grad, reference_x.grad)
    if bias:
        torch.testing.assert_close(layer.bias.grad, reference_bias.grad)


def test_backward_saves_the_int8_parameter_not_a_dequantized_weight() -> None:
    # torchao's own int8 linear lets autograd save the converted bf16 weight: a recomputed block would hold
    # a bf16 copy of every frozen linear until its backward ran.
    layer = int8_layer(bias=False)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    x = torch.randn(4, 96, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    assert any(t is layer.weight for t in saved)
    dequantized = [t for t in saved if t is not layer.weight and t.shape == layer.weight.shape]
    assert not dequantized  # (the int8 parameter reports its original dtype, bf16, as torchao's tensors do)
    out.sum().backward()
    assert x.grad is not None


def test_under_autocast_the_weight_is_dequantized_straight_to_the_autocast_dtype() -> None:
    layer = int8_layer(bias=True)
    x = torch.randn(3, 96, requires_grad=True)  # float32, as a model trained with mixed_precision: bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        reference = F.linear(x, layer.weight.dequantize(torch.bfloat16), layer.bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference)
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


@pytest.mark.gpu
def test_the_triton_dequantization_equals_torchaos_on_gpu() -> None:
    for rows, columns in ((1024, 512), (3072, 6144), (96, 2100), (5, 24576)):  # whole and partial blocks
        torch.manual_seed(0)
        layer = nn.Linear(columns, rows, bias=False, dtype=torch.bfloat16, device="cuda")
        quantize_frozen_weights(layer.requires_grad_(False), "int8")
        weight = layer.weight
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert torch.equal(dequantize(weight, dtype), weight.dequantize(dtype)), (rows, columns, dtype)
        zero_point = torch.randint(-3, 4, weight.zero_point.shape, dtype=torch.int8, device="cuda")
        expected = weight_from_codes(weight.qdata, weight.scale, zero_point, torch.bfloat16)
        on_device = int8_linear._dequantize_on_device(weight.qdata, weight.scale, zero_point, torch.bfloat16)
        assert torch.equal(on_device, expected)
    assert not int8_linear._KERNEL_FAILED


def test_a_compiled_int8_linear_traces_the_dequantization_in_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA the weight comes from a Triton kernel that dynamo cannot trace; a stand-in for it on the CPU (with
    # the graph break it would cause) runs eagerly, and the compiled layer must not reach it.
    launches: list[torch.Tensor] = []

    def untraceable_kernel(*parts: object) -> torch.Tensor:
        torch._dynamo.graph_break()
        launches.append(parts[0])  # type: ignore[arg-type]
        return weight_from_codes(*parts)  # type: ignore[arg-type]

    monkeypatch.setattr(int8_linear, "_KERNEL_DEVICE", "cpu")
    monkeypatch.setattr(int8_linear, "_dequantize_on_device", untraceable_kernel)
    layer = int8_layer(bias=True)
    x = torch.randn(4, 96, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    eager = layer(x)
    assert len(launches) == 1  # eagerly the kernel computes the weight
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)  # fullgraph: a break is an error
    compiled.sum().backward()
    assert len(launches) == 1 and torch.equal(compiled, eager)
