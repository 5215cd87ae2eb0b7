"""Flux.1's per-block modulation computed once per DiT call, so its weights cross the link once a step, not twice.

Every block of Flux.1's DiT turns ``temb = time(t) + guidance(g) + pooled text`` into the scales, shifts and
gates of its streams through Linear layers: a double block's ``norm1.linear`` and ``norm1_context.linear``
(``dim -> 6 dim``), a single block's ``norm.linear`` (``dim -> 3 dim``): 3.2B of Flux.1-dev's 12B parameters.
The pooled text varies per prompt and enters before a SiLU, so no table per timestep applies (Qwen-Image's,
modulation_table.py). But every block's rows are a function of ``temb`` alone. So this module moves those Linears
out of the blocks into units of their own (``FluxModulation``, a child of the DiT whose ``ModuleList`` children
the engine streams as block units), computes every block's rows as soon as the DiT has computed ``temb`` (a
forward hook on ``time_text_embed``), and each block looks its rows up. With gradient checkpointing the backward's
recomputation of a block then reads the rows kept on the device (``batch x 6 dim`` per block) instead of
streaming those weights a second time.

Each row is the call the block makes (the Linear on ``silu(temb)`` for the whole batch, under the forward's
autocast), so the DiT's output and gradients are bitwise its own (tests/jobs/models/diffusion/test_flux_modulation.py).
The rows need no graph: the Linears' base weights are frozen and ``temb`` needs no gradient under a LoRA that
leaves ``time_text_embed`` alone; both are checked. A LoRA on the modulation layers still trains: its adapter
stays in the block and computes beside the looked-up base output.

Example:
    >>> modulation = FluxModulation.install(dit)  # before the engine attaches: the Linears become its units
    >>> velocity = dit(...)  # every block's rows computed once, right after time_text_embed
    >>> modulation.remove(dit)  # the exact inverse
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

ATTRIBUTE = "flux_modulation"  # the DiT's child that holds the Linears while they are precomputed
FLUX1_CLASS = "FluxTransformer2DModel"
# Each list of blocks and the AdaLayerNormZero(Single) modules of its blocks whose ``linear`` reads temb.
NORMS = (("transformer_blocks", ("norm1", "norm1_context")), ("single_transformer_blocks", ("norm",)))
LAYER_NAMES = "norm1.linear, norm1_context.linear and norm.linear"


def flux_modulation_problem(config: Any) -> str | None:
    """Why a Flux DiT of this config cannot precompute its modulation, or None (Flux.1)."""
    name = config.get("_class_name")
    if name == "Flux2Transformer2DModel":
        return (
            "Flux.2's DiT computes its modulation once per call already (double_stream_modulation_img/txt, "
            "single_stream_modulation): it has no per-block layers to precompute"
        )
    if name != FLUX1_CLASS:
        return f"expected Flux.1's {FLUX1_CLASS}; got {name}"
    return None


class _Rows:
    """The rows of the DiT's latest call, shared by the lookups. A plain object: were it a module, every block
    that looks rows up would own the Linears, and the engine would stream them with the block again."""

    def __init__(self) -> None:
        self.current: list[list[torch.Tensor]] | None = None  # [block][layer]: [batch, k dim] each


class _LookedUpRows(nn.Module):
    """Stands in for a block's modulation Linear: returns the rows computed for it at the start of the call."""

    def __init__(self, rows: _Rows, block: int, layer: int, name: str) -> None:
        super().__init__()
        self.rows, self.block, self.layer, self.name = rows, block, layer, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        current = self.rows.current
        if current is None:
            raise RuntimeError(
                f"{self.name}: this DiT's modulation is precomputed (jobs/models/diffusion/flux/modulation.py) "
                "from time_text_embed's output, and no call has computed it yet"
            )
        out = current[self.block][self.layer]
        if out.shape[0] != x.shape[0]:
            raise RuntimeError(f"{self.name}: modulation rows for {out.shape[0]} samples, a batch of {x.shape[0]}")
        return out

    def extra_repr(self) -> str:
        return self.name


class BlockModulation(nn.Module):
    """One block's modulation Linears, named as the block's norms: one unit of the offload engine."""

    def __init__(self, linears: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, linear in linears.items():
            self.add_module(name, linear)

    def forward(self, emb: torch.Tensor) -> list[torch.Tensor]:
        return [linear(emb) for linear in self.children()]


class FluxModulation(nn.Module):
    """Every block's modulation Linears, out of the blocks; computes their rows once per DiT call.

    Its two ``ModuleList`` s mirror the DiT's (``transformer_blocks``, ``single_transformer_blocks``), so with
    block granularity each block's Linears are one unit (``flux_modulation.transformer_blocks.3``), visited in
    the forward right after ``time_text_embed`` and never in the backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList()
        self.single_transformer_blocks = nn.ModuleList()
        self._rows = _Rows()
        self._replaced: list[tuple[nn.Module, str, nn.Module]] = []  # (owner, attribute, original Linear)
        self._handle: RemovableHandle | None = None

    @classmethod
    def install(cls, dit: nn.Module) -> FluxModulation:
        """Move ``dit``'s modulation Linears into a ``FluxModulation`` and compute their rows from each call's
        ``temb``. Refuses a DiT other than Flux.1's and a modulation whose inputs or base layers train."""
        problem = flux_modulation_problem({"_class_name": type(dit).__name__}) or trained_modulation(dit)
        if problem:
            raise ValueError(f"model.precompute_modulation: {problem}")
        return cls.separate(dit)

    @classmethod
    def separate(cls, dit: nn.Module) -> FluxModulation:
        """``install`` without its checks: also what the fit check does to the meta DiT, to plan the units the
        engine will stream."""
        if hasattr(dit, ATTRIBUTE):
            raise ValueError(f"this DiT's modulation is precomputed already ({ATTRIBUTE})")
        modulation = cls()
        for blocks_name, norms in NORMS:
            for index, block in enumerate(getattr(dit, blocks_name)):
                position = len(modulation.transformer_blocks) + len(modulation.single_transformer_blocks)
                linears = {}
                for layer, norm in enumerate(norms):
                    owner, attribute, linear = _base_linear(getattr(block, norm))
                    name = f"{blocks_name}.{index}.{norm}.linear"
                    modulation._replaced.append((owner, attribute, linear))
                    setattr(owner, attribute, _LookedUpRows(modulation._rows, position, layer, name))
                    linears[norm] = linear
                getattr(modulation, blocks_name).append(BlockModulation(linears))
        dit.add_module(ATTRIBUTE, modulation)
        time_text_embed: Any = dit.time_text_embed
        modulation._handle = time_text_embed.register_forward_hook(modulation._compute_rows_after_time_embedding)
        return modulation

    def forward(self, temb: torch.Tensor) -> list[list[torch.Tensor]]:
        """Every block's rows, ``[block][layer]``: its Linears on ``silu(temb)``, as AdaLayerNormZero computes them."""
        emb = F.silu(temb)
        return [block(emb) for block in [*self.transformer_blocks, *self.single_transformer_blocks]]

    def _compute_rows_after_time_embedding(self, module: nn.Module, args: Any, temb: torch.Tensor) -> None:
        if temb.requires_grad and torch.is_grad_enabled():
            # The rows would carry a graph that every block's backward walks: refuse rather than train wrongly.
            raise RuntimeError(
                "model.precompute_modulation: time_text_embed's output requires grad (a trainable layer or input "
                "in it); the precomputed modulation needs it frozen: set model.precompute_modulation: false"
            )
        # Frozen weights, an input without grad: the rows need no graph. They stay on the device until the next
        # call (batch x 6 dim a block), since the backward's recomputation of every block reads them.
        with torch.no_grad():
            self._rows.current = self(temb)

    def remove(self, dit: nn.Module) -> None:
        """Put the Linears back into the blocks and drop the hook: the exact inverse of ``install``."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for owner, attribute, linear in self._replaced:
            setattr(owner, attribute, linear)
        self._replaced.clear()
        self._rows.current = None
        delattr(dit, ATTRIBUTE)

    def __repr__(self) -> str:
        params = list(self.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in params)
        device = params[0].device if params else None
        return (
            f"FluxModulation(blocks={len(self.transformer_blocks)}+{len(self.single_transformer_blocks)}, "
            f"device={device}, {nbytes} bytes)"
        )


def flux_modulation(dit: nn.Module) -> FluxModulation | None:
    """The DiT's installed ``FluxModulation``, or None."""
    found = getattr(dit, ATTRIBUTE, None)
    return found if isinstance(found, FluxModulation) else None


def trained_modulation(dit: nn.Module) -> str | None:
    """What trains of the modulation's input (``time_text_embed``) and base layers, or None: the rows are
    computed without a graph, so they must stay frozen."""
    embedder: Any = dit.time_text_embed
    if any(p.requires_grad for p in embedder.parameters()):
        return "time_text_embed trains (a LoRA target matches it); the precomputed modulation needs it frozen"
    for blocks_name, norms in NORMS:
        for index, block in enumerate(getattr(dit, blocks_name)):
            for norm in norms:
                _, _, linear = _base_linear(getattr(block, norm))
                if any(p.requires_grad for p in linear.parameters()):
                    return (
                        f"{blocks_name}.{index}.{norm}.linear trains; the precomputed modulation needs its base "
                        "weights frozen (LoRA)"
                    )
    return None


def _base_linear(norm: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """(owner, attribute, Linear) of a norm's ``linear``: the Linear itself, or the ``base_layer`` of peft's LoRA
    wrapper around it (a quantized Linear included)."""
    layer: Any = norm.linear
    base = getattr(layer, "base_layer", None)
    if base is not None:
        return layer, "base_layer", base
    return norm, "linear", layer
