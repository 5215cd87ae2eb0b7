"""A ``torch.compile``d region inside a streamed unit: its backward unpacks every saved weight, then drops the
saved tensors before it runs its graph (AOTAutograd frees activations early). The engine keeps the weights it
unpacked on the device until that node has run, as it would after an eager node, so the ring slot is not
freed before the node's kernels are queued and a quantized weight's parameter object is not swapped back to its
host contents while the graph still computes with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import OffloadOptions, OffloadTrainingManager

WIDTH = 128  # NF4 needs whole blocks of 64 x 256 weights


class Block(nn.Module):
    """A frozen projection with a trainable adapter: the shape of a LoRA layer, compiled as one region."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, 2 * WIDTH, bias=False, dtype=dtype).requires_grad_(False)
        self.out = nn.Linear(2 * WIDTH, WIDTH, bias=False, dtype=dtype).requires_grad_(False)
        self.adapter = nn.Linear(WIDTH, 2 * WIDTH, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.silu(self.base(x) + self.adapter(x)))


class BrokenBlock(Block):
    """``Block`` with a graph break inside its forward, as a Triton kernel dynamo cannot trace or a fused-kernel
    library's autograd function makes (on CUDA, the int8 dequantization kernel and Liger's did): dynamo
    restarts its analysis at the break, and the dropped attempt leaves weak references on the weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x)
        torch._dynamo.graph_break()
        return x + self.out(F.silu(h + self.adapter(x)))


def _stack(quantize: str | None, dtype: torch.dtype, kind: type[Block] = Block) -> nn.ModuleList:
    torch.manual_seed(0)
    blocks = nn.ModuleList(kind(dtype) for _ in range(3))
    if quantize is not None:
        from offload.quant.quantized import quantize_frozen_weights

        assert len(quantize_frozen_weights(blocks, quantize)) == 6
    return blocks


def _compiled(blocks: nn.ModuleList, backend: str = "aot_eager") -> None:
    compiled = torch.compile(type(blocks[0]).forward, backend=backend)  # one wrapper, every block as its ``self``
    for block in blocks:
        block.forward = compiled.__get__(block)


def _train(
    blocks: nn.ModuleList,
    *,
    offload: bool,
    compiled: bool,
    dtype: torch.dtype,
    device: str = "cpu",
    backend: str = "aot_eager",
    **more: Any,
) -> list[torch.Tensor]:
    torch._dynamo.reset()
    if compiled:
        _compiled(blocks, backend)
    options = OffloadOptions(granularity="block", gpu_memory_budget=None, **more)  # every block streams
    manager = OffloadTrainingManager(blocks, device, options=options) if offload else None
    if not offload:
        blocks.to(device)  # resident
    grads = []
    for step in range(2):
        x = torch.randn(4, WIDTH, dtype=dtype, generator=torch.Generator().manual_seed(step)).to(device)
        x.requires_grad_()
        h = x
        for block in blocks:
            h = block(h)
        h.float().pow(2).mean().backward()
        if manager is not None:
            manager.after_backward()
        grads += [x.grad.cpu()] + [b.adapter.weight.grad.cpu() for b in blocks]
        blocks.zero_grad()
    if manager is not None:
        assert manager.stats().ring_overflows == 0
        manager.remove()
    return grads


def test_a_compiled_backward_keeps_the_weights_it_unpacked_until_it_ran() -> None:
    blocks = _stack(None, torch.float32)
    _compiled(blocks)
    manager = OffloadTrainingManager(blocks, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=None))
    offloader = manager._offloaders[id(blocks[1].base.weight)]
    seen: dict[str, Any] = {}

    def after_the_node(grad_inputs: Any, grad_outputs: Any) -> None:  # registered first: runs before the engine's
        seen["resident"] = offloader.resident

    x = torch.randn(4, WIDTH, requires_grad=True)
    middle = blocks[1](blocks[0](x))
    node = middle.grad_fn  # the middle block's compiled region
    assert node is not None and type(node).__name__ == "CompiledFunctionBackward"
    node.register_hook(after_the_node)
    blocks[2](middle).sum().backward()
    # The node dropped its saved tensors before running its graph; the weight stayed until the node had run.
    assert seen["resident"] is True
    assert not offloader.resident  # and was let go after it
    manager.after_backward()
    manager.remove()


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_compiled_streamed_quantized_blocks_train_as_eager(quantize: str) -> None:
    pytest.importorskip("torchao")
    dtype = torch.bfloat16
    eager = _train(_stack(quantize, dtype), offload=False, compiled=False, dtype=dtype)
    streamed = _train(_stack(quantize, dtype), offload=True, compiled=False, dtype=dtype)
    compiled = _train(_stack(quantize, dtype), offload=True, compiled=True, dtype=dtype)
    # aot_eager runs the same aten ops; a streamed NF4 weight is dequantized on arrival with torchao's values:
    # all three are equal bit for bit.
    for a, b, c in zip(eager, streamed, compiled, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_a_graph_break_in_a_compiled_block_leaves_its_quantized_weights_swappable(quantize: str) -> None:
    pytest.importorskip("torchao")
    dtype = torch.bfloat16
    eager = _train(_stack(quantize, dtype, BrokenBlock), offload=False, compiled=False, dtype=dtype)
    # Each block's quantized weights are swapped to their device contents and back while dynamo's weak
    # references from the restarted trace are still on them (swap_tensors refuses those).
    compiled = _train(_stack(quantize, dtype, BrokenBlock), offload=True, compiled=True, dtype=dtype)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)  # aot_eager: the same aten ops


@pytest.mark.slow
def test_inductor_over_streamed_int8_blocks_with_a_graph_break_trains_as_resident() -> None:
    # Real code generation (C++ on the CPU): the streamed weights are views into the ring; resident, tensors
    # of their own. The same generated kernels run both.
    pytest.importorskip("torchao")
    dtype = torch.bfloat16
    resident = _train(_stack("int8", dtype, BrokenBlock), offload=False, compiled=True, dtype=dtype,
                      backend="inductor")  # fmt: skip
    streamed = _train(_stack("int8", dtype, BrokenBlock), offload=True, compiled=True, dtype=dtype,
                      backend="inductor")  # fmt: skip
    for a, b in zip(resident, streamed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "quantize",
    [
        "nf4",
        pytest.param(
            "int8",
            marks=pytest.mark.xfail(
                reason="on an H100 (torch 2.11, commit f02ebe7) this failed: the int8 payload could not be swapped back (weak references dynamo left at the graph break its Triton dequantization made; both mended since, not rerun there); training.compile over the offload engine is refused on CUDA until it passes (jobs/fit/checks.py)",
                strict=False,
            ),
        ),
        None,
    ],
)
def test_on_the_gpu_compiled_streamed_blocks_train_as_eager(quantize: str | None) -> None:
    # There the copies run on the copy stream: a slot released before the compiled backward's kernels were queued
    # could be overwritten under them, and an int8 weight swapped back to its host payload is on the wrong device.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if quantize is not None:
        pytest.importorskip("torchao")
    dtype = torch.bfloat16
    streamed = _train(_stack(quantize, dtype), offload=True, compiled=False, dtype=dtype, device="cuda")
    compiled = _train(_stack(quantize, dtype), offload=True, compiled=True, dtype=dtype, device="cuda")
    for a, b in zip(streamed, compiled, strict=True):
        assert torch.equal(a, b)  # aot_eager: the same kernels


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("quantize", ["nf4", "int8", None])
def test_inductor_over_streamed_blocks_trains_as_over_resident_ones(quantize: str | None, device: str) -> None:
    # The same generated kernels, over weights resident on the device or streamed through the ring (views at
    # offsets into it, copied on the copy stream): any difference is the engine's CUDA path under inductor. NF4
    # stays torchao's tensor in the layer, as it is resident (dequantized on arrival it would compute as a plain
    # weight: other kernels).
    if quantize is not None:
        pytest.importorskip("torchao")
    dtype = torch.bfloat16
    resident = _train(_stack(quantize, dtype), offload=False, compiled=True, dtype=dtype, device=device,
                      backend="inductor")  # fmt: skip
    streamed = _train(_stack(quantize, dtype), offload=True, compiled=True, dtype=dtype, device=device,
                      backend="inductor", dequantize_on_arrival=False)  # fmt: skip
    for a, b in zip(resident, streamed, strict=True):
        assert torch.equal(a, b)
