"""A decoder layer's MLP over tiles of the sequence, each tile checkpointed (``model.tiled_mlp``).

At long sequences a gated MLP's intermediates are most of what one decoder layer's backward holds: gate, up, their
activation and product are four ``intermediate_size`` vectors per token (7 GB at 32768 tokens of a 27648-wide
bf16 MLP), where the checkpointed layer's other activations are about ten ``hidden_size`` ones. An MLP is
position-wise, so its output for a slice of positions is its output on that slice: here it runs over tiles of
about ``tokens`` tokens (all rows, a slice of positions), each under torch's non-reentrant checkpoint, and the
tiles' outputs are concatenated. A tile's forward keeps only its input; backward recomputes one tile at a time,
so a layer's backward holds one tile's intermediates instead of the whole sequence's (Arctic Long Sequence
Training's TiledMLP, Unsloth's tiled MLP). The cost is one more forward of the MLP per step, except in the
checkpointed layers below.

Each row goes through the same layers, so values and gradients are training's without it to float rounding: a
matmul kernel may block fewer rows differently, and a weight's gradient (an adapter's) sums its tokens tile by
tile (tests/jobs/recompute/test_tiled_mlp.py). Dropout inside an MLP (GPT-2's) draws its masks tile by tile: other
draws, the same distribution.

Only MLPs known to be position-wise are tiled, recognized by their children: Llama-style gate/up/down (Llama,
Qwen2/3, Mistral, Gemma, a mixture-of-experts model's dense layers), Phi-3's fused gate_up, GPT-2's and
GPT-NeoX's two layers. A mixture of experts (its router and experts) is left alone. ``install`` overrides the
instance's ``forward`` only: module names, state-dict keys and peft's adapters are untouched; ``remove`` is its
exact inverse. Whether a job tiles (``auto``: only where its memory estimate needs it) is the fit check's
decision (jobs/fit/estimate.py ``with_mlp_tiling_decided``): the extra forward is not paid where it buys nothing.

Inside a checkpointed layer the MLP ran three forwards a step: the layer's forward, its recompute, and each tile's
recompute in backward. The middle one computes values nothing reads where the MLP's output goes only into the
residual sum (whose backward reads no value) and the recompute's outputs serve backward alone: there the tiled
MLP returns zeros, and its backward recomputes each tile from the saved input (the random numbers the layer's
forward drew replayed) and backpropagates it, the same work as before less one MLP forward. Which layers qualify is
read from their children: a pre-norm layer of attention, MLP and the two norms (Llama, Qwen2/3, Mistral, Gemma)
or GPT-2's block. A layer that normalizes the MLP's output (Gemma 2/3, OLMo 2) keeps computing it.

The offload engine streams a layer's weights and restores them on the device before backward through the
tensors autograd saves (offload/saved_tensors.py). Inside a tile's checkpoint those saves go to the checkpoint,
not to the engine, so the MLP's weights are also saved around the tiles: once before them, which keeps them
counted as needed until the last tile's backward is done, and once after them, whose backward onloads them before
the first tile is recomputed.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from jobs.recompute.flags import recomputing
from jobs.recompute.replay import ForwardState

log = logging.getLogger(__name__)

TILE_BYTES = 2**29  # a tile's MLP intermediates, by default
MIN_TILE_TOKENS = 1024  # fewer rows per matmul than this costs more in launches than it saves
INTERMEDIATES_PER_TOKEN = 4  # gate, up, activation, product: intermediate_size values each
# The children of the MLPs known to be position-wise (their forward maps each position alone).
POSITION_WISE = (
    frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"}),  # Llama, Qwen2/3, Mistral, Gemma
    frozenset({"gate_up_proj", "down_proj", "activation_fn"}),  # Phi-3
    frozenset({"c_fc", "c_proj", "act", "dropout"}),  # GPT-2
    frozenset({"dense_h_to_4h", "dense_4h_to_h", "act"}),  # GPT-NeoX
)
_ATTRIBUTE = "ferry_tiled_mlp"
# The children of decoder layers whose MLP output only the residual sum reads (``hidden = residual + mlp(...)``).
RESIDUAL_LAST = (
    frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}),  # Llama, Qwen2/3, Mistral, Gemma
    frozenset({"ln_1", "attn", "ln_2", "mlp"}),  # GPT-2
)


def default_tile_tokens(intermediate: int, element_size: int) -> int:
    """Tokens per tile whose MLP intermediates take about ``TILE_BYTES``: a power of two, at least
    ``MIN_TILE_TOKENS`` (2048 for a 27648-wide bf16 MLP, 4096 for a 14336-wide one)."""
    fits = TILE_BYTES // (INTERMEDIATES_PER_TOKEN * intermediate * element_size)
    return max(MIN_TILE_TOKENS, 1 << max(fits, 1).bit_length() - 1)


def tileable_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers' MLPs (modules named ``mlp``) that are known to be position-wise."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "mlp" and frozenset(n for n, _ in module.named_children()) in POSITION_WISE
    ]


class TiledMLP:
    """What one MLP instance tiles by, kept on it while its ``forward`` is overridden.

    Args:
        tokens: Tokens per tile (all the rows of a slice of positions); an input of no more runs whole.
    """

    def __init__(self, tokens: int, residual_last: bool = False) -> None:
        self.tokens = tokens
        self.residual_last = residual_last  # the layer's output is residual + this MLP's: the recompute skips it
        self.forward: Any = None  # the instance's own forward attribute before install, if it had one

    def applies(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` (rows x positions x hidden) runs tiled."""
        return x.dim() == 3 and x.shape[0] * x.shape[1] > self.tokens

    def __repr__(self) -> str:
        return f"TiledMLP(tokens={self.tokens}, residual_last={self.residual_last})"


def install(model: nn.Module, tokens: int) -> int:
    """Tile every position-wise MLP of ``model`` (module docstring); returns how many. A model with none is
    logged as a warning: the spec asked for tiling that will not happen."""
    mlps = tileable_mlps(model)
    modules = dict(model.named_modules())
    for name, mlp in mlps:
        if hasattr(mlp, _ATTRIBUTE):
            continue
        layer = modules.get(name.rpartition(".")[0]) if "." in name else None
        children = frozenset(n for n, _ in layer.named_children()) if layer is not None else frozenset()
        tiles = TiledMLP(tokens, residual_last=children in RESIDUAL_LAST)
        tiles.forward = mlp.__dict__.get("forward")
        setattr(mlp, _ATTRIBUTE, tiles)
        mlp.forward = functools.partial(_tiled_forward, mlp, mlp.forward, tiles)
    if not mlps:
        log.warning("model.tiled_mlp: %s has no position-wise MLP to tile; nothing is tiled", type(model).__name__)
    return len(mlps)


def remove(model: nn.Module) -> None:
    """Undo ``install``: every MLP's ``forward`` is its own again."""
    for module in model.modules():
        tiles = module.__dict__.pop(_ATTRIBUTE, None)
        if not isinstance(tiles, TiledMLP):
            continue
        del module.forward
        if tiles.forward is not None:
            module.forward = tiles.forward


def _tiled_forward(mlp: nn.Module, forward: Any, tiles: TiledMLP, x: torch.Tensor) -> torch.Tensor:
    if not tiles.applies(x):
        return forward(x)
    positions = max(1, tiles.tokens // x.shape[0])  # a tile keeps every row: per-row hooks (DPO's) still hold
    if not torch.is_grad_enabled():  # a checkpointed layer's first forward, or evaluation: nothing to save
        return torch.cat([forward(part) for part in x.split(positions, dim=1)], dim=1)
    weights = tuple(mlp.parameters())
    kept = _KeepForBackward.apply(x, weights)
    if tiles.residual_last and recomputing():
        return _OnloadBeforeBackward.apply(_TilesInBackward.apply(kept, forward, positions), weights)
    outputs = [checkpoint(forward, part, use_reentrant=False) for part in kept.split(positions, dim=1)]
    return _OnloadBeforeBackward.apply(torch.cat(outputs, dim=1), weights)


class _TilesInBackward(torch.autograd.Function):
    """The MLP over ``x`` in a layer's recompute, whose output backward reads no value of: zeros now, and in
    backward each tile recomputed and backpropagated in turn (its adapters' gradients accumulate there, as in a
    reentrant checkpoint). The random numbers the forward drew are replayed: the tiles run in the order, and
    from the generator states, of the layer's own forward, which the recompute replays up to here."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: Any, positions: int) -> torch.Tensor:
        ctx.forward, ctx.positions = forward, positions
        ctx.state = ForwardState.capture(x)
        ctx.save_for_backward(x)
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (x,) = ctx.saved_tensors
        grads = []
        with ctx.state.replay():
            for part, part_grad in zip(x.split(ctx.positions, dim=1), grad.split(ctx.positions, dim=1), strict=True):
                part = part.detach().requires_grad_(ctx.needs_input_grad[0])
                with torch.enable_grad():
                    output = ctx.forward(part)
                if output.requires_grad:
                    torch.autograd.backward(output, part_grad)
                grads.append(part.grad)
        grad_x = torch.cat(grads, dim=1) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


class _KeepForBackward(torch.autograd.Function):
    """Identity that saves the MLP's weights: they stay needed (and on the device) until every tile's backward ran."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ctx.save_for_backward(*weights)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _OnloadBeforeBackward(torch.autograd.Function):
    """Identity whose backward reads the MLP's saved weights, onloading them before the tiles are recomputed."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ctx.save_for_backward(*weights)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.saved_tensors  # noqa: B018 (unpacking is the point: the engine onloads what it unpacks)
        return grad, None
