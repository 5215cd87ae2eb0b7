"""What an int8 frozen linear costs on the device: one dequantization of a weight (``Int8Linear``'s Triton
kernel against torchao's ``Int8Tensor.dequantize``), then forward + backward of one linear (``Int8Linear``
against torchao's own int8 linear), at Flux.2-dev's projection shapes and 4096 + 512 tokens.

Run on a GPU box:  python bench/int8_dequant_probe.py     (prints a table; about 20 s after start-up)
Nothing is written to bench/RESULTS.md (its Flux.2 section quotes these lines).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.optimizer_quant_bench import per_call_us
from offload.quant.int8_linear import Int8Linear, dequantize
from offload.quant.quantized import quantize_frozen_weights

# (out, in): Flux.2-dev's single block's fused qkv + MLP input (3 * 6144 + 2 * 3 * 6144 = 55296 rows), its
# fused output projection (attention 6144 + MLP 18432 in), and one double block attention projection.
SHAPES = ((55296, 6144), (6144, 24576), (6144, 6144))
TOKENS = 4096 + 512
Timer = Callable[[Callable[[], object], int], float]


def device_ms(run: Callable[[], object], calls: int) -> float:
    """Milliseconds per call, issued and finished (autograd on: the forward + backward rows need it)."""

    def with_grad() -> None:
        with torch.enable_grad():
            run()

    return per_call_us(with_grad, calls)[1] / 1e3


def int8_linear(rows: int, columns: int, device: str) -> nn.Linear:
    layer = nn.Linear(columns, rows, bias=False, dtype=torch.bfloat16, device=device).requires_grad_(False)
    quantize_frozen_weights(layer, "int8")
    assert type(layer) is Int8Linear
    return layer


def one_shape(rows: int, columns: int, tokens: int, device: str, timer: Timer, calls: int) -> str:
    """The table's row for one weight shape."""
    layer = int8_linear(rows, columns, device)
    weight = layer.weight
    assert torch.equal(dequantize(weight, torch.bfloat16), weight.dequantize(torch.bfloat16))
    ours = timer(lambda: dequantize(weight, torch.bfloat16), calls)
    theirs = timer(lambda: weight.dequantize(torch.bfloat16), calls)
    moved = rows * columns * 3 / (ours * 1e-3) / 1e12  # one int8 byte read, two bf16 bytes written
    x = torch.randn(1, tokens, columns, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.ones(1, tokens, rows, dtype=torch.bfloat16, device=device)

    def step(forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        forward(x).backward(grad)
        x.grad = None

    ours_step = timer(lambda: step(layer), calls)
    theirs_step = timer(lambda: step(lambda t: F.linear(t, weight)), calls)  # torchao's int8 linear (dispatch)
    return f"| {rows} x {columns} | {ours:.3f} | {moved:.2f} | {theirs:.3f} | {ours_step:.2f} | {theirs_step:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--device", default="cuda", help="cpu: both sides run eager ops, no Triton (a smoke run)")
    parser.add_argument("--divide", type=int, default=1, help="divide every shape and the tokens (a smoke run)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for a smoke run")
    timer = device_ms if args.device == "cuda" else _cpu_ms
    print(
        "| weight (out x in) | Int8Linear dequantize (ms) | read + write (TB/s) | torchao dequantize (ms) "
        "| fwd+bwd Int8Linear (ms) | fwd+bwd torchao (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for rows, columns in SHAPES:
        shape = (rows // args.divide, columns // args.divide)
        print(one_shape(*shape, TOKENS // args.divide, args.device, timer, args.calls), flush=True)


def _cpu_ms(run: Callable[[], object], calls: int) -> float:
    run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) * 1e3 / calls


if __name__ == "__main__":
    main()
