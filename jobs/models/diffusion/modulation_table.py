"""Qwen-Image's per-block modulation computed once per timestep, so its weights never cross the link.

Every block of Qwen-Image's DiT turns the timestep embedding into the scales, shifts and gates of its two
streams through two Linear layers, ``img_mod.1`` and ``txt_mod.1`` (``dim -> 6 dim``): 113M of a block's
340M parameters, a third of the 60-layer model's 40.9 GB. Their input depends on the timestep alone, and
training draws timesteps from a fixed schedule (1000 sigmas, 378 distinct once cast to bfloat16 as the DiT
casts them). With their base weights frozen (LoRA), each layer's base output is a function of the timestep:
this module computes it once per timestep the job will use (training's schedule and the samples' steps),
keeps the rows in host memory (4.4 MB a timestep for the 60-layer model, 1.7 GB for the bf16 schedule),
and hands each batch its rows. Under model offload the engine then streams two thirds of every block, in
the forward and again in the backward; a LoRA on those layers still trains (its adapter runs as before,
beside the looked-up base output).

Each row is computed by the same call the DiT makes for a batch of one (``F.linear`` on one row, under the
job's autocast), so a batch of one sees bitwise the values it would compute itself
(tests/jobs/models/diffusion/test_modulation_table.py). A batch of several timesteps gets each sample's own row,
where the DiT's one matrix product over the batch may round differently in the last bit.

Example:
    >>> table = precompute_modulation(dit, sigmas, device, autocast=contextlib.nullcontext)
    >>> table.feed(table.rows_for(batch_sigmas).to(device))
    >>> velocity = dit(...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTRIBUTE = "precomputed_modulation"  # where the DiT carries its table (absent: the DiT computes its own)
STREAMS = ("img_mod", "txt_mod")


def modulation_problem(config: Any) -> str | None:
    """Why a DiT of this config cannot use a table (its modulation sees more than the timestep), or None."""
    if config.get("_class_name") != "QwenImageTransformer2DModel":
        return f"only Qwen-Image's DiT has per-block modulation layers to precompute; got {config.get('_class_name')}"
    for option in ("zero_cond_t", "use_additional_t_cond", "guidance_embeds"):
        if config.get(option):
            return f"transformer/config.json sets {option}: its modulation depends on more than the timestep"
    return None


class _LookedUpRows(nn.Module):
    """Stands in for a modulation Linear: returns the table's rows of the batch being computed."""

    def __init__(self, table: ModulationTable, block: int, stream: int) -> None:
        super().__init__()
        self.table, self.block, self.stream = table, block, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.table.current
        if rows is None:
            raise RuntimeError(
                "this DiT's modulation is precomputed (jobs/models/diffusion/modulation_table.py): call "
                "table.feed(table.rows_for(sigma)) before it, or remove the table first"
            )
        out = rows[self.block, self.stream]
        if out.shape[0] != x.shape[0]:
            raise RuntimeError(f"modulation rows for {out.shape[0]} samples fed to a batch of {x.shape[0]}")
        return out

    def extra_repr(self) -> str:
        return f"block={self.block}, {STREAMS[self.stream]}"


class ModulationTable:
    """The base outputs of every block's ``img_mod.1`` and ``txt_mod.1``, one row per known timestep.

    Attributes:
        keys: The timesteps as the DiT's time embedding sees them (float64, ascending, CPU).
        rows: ``[timesteps, blocks, 2, 6 dim]`` on the CPU, in the layers' output dtype.
        current: The rows of the DiT's calls (``feed``), ``[blocks, 2, batch, 6 dim]``.
    """

    def __init__(self, keys: torch.Tensor, rows: torch.Tensor, as_dit_sees: Callable[[torch.Tensor], torch.Tensor]):
        self.keys, self.rows, self._as_dit_sees = keys, rows, as_dit_sees
        self.current: torch.Tensor | None = None
        self._replaced: list[tuple[nn.Module, str, nn.Module]] = []  # (owner, attribute, original layer)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def rows_for(self, sigma: torch.Tensor) -> torch.Tensor:
        """``[blocks, 2, batch, 6 dim]`` (CPU) for a batch's sigmas. A sync if ``sigma`` is on the device."""
        wanted = self._as_dit_sees(sigma.detach().cpu())
        index = torch.searchsorted(self.keys, wanted).clamp(max=len(self.keys) - 1)
        missing = self.keys[index] != wanted
        if bool(missing.any()):
            raise KeyError(
                f"no precomputed modulation for sigma {sigma.cpu()[missing].tolist()}: the table holds the "
                "training schedule and the samples' steps it was built for"
            )
        return self.rows[index].permute(1, 2, 0, 3).contiguous()

    def feed(self, rows: torch.Tensor | None) -> None:
        """The DiT's next calls use ``rows`` (on the compute device) as their modulation. They stay fed until the
        next ``feed``: the backward recomputes checkpointed blocks after the forward has returned."""
        if rows is None:
            raise ValueError("this DiT's modulation is precomputed: its batch needs rows (batch['modulation'])")
        self.current = rows

    def install(self, dit: nn.Module) -> None:
        """Put the lookups in place of the base layers (kept here, off the model) and mark the DiT."""
        blocks: Any = dit.transformer_blocks
        for block_index, block in enumerate(blocks):
            for stream, name in enumerate(STREAMS):
                owner, attribute, _ = _base_linear(getattr(block, name)[1], getattr(block, name))
                self._replaced.append((owner, attribute, getattr(owner, attribute)))
                setattr(owner, attribute, _LookedUpRows(self, block_index, stream))
        setattr(dit, ATTRIBUTE, self)

    def remove(self, dit: nn.Module) -> None:
        """Put the original layers back: the exact inverse of ``install``."""
        for owner, attribute, original in self._replaced:
            setattr(owner, attribute, original)
        self._replaced.clear()
        self.current = None
        delattr(dit, ATTRIBUTE)

    def __repr__(self) -> str:
        return f"ModulationTable(timesteps={len(self.keys)}, rows={tuple(self.rows.shape)}, {self.nbytes} bytes)"


def modulation_table(model: nn.Module) -> ModulationTable | None:
    return getattr(model, ATTRIBUTE, None)


def feed_modulation(model: nn.Module, rows: torch.Tensor | None) -> None:
    """``table.feed(rows)`` for a DiT with a table; nothing for one that computes its own modulation."""
    table = modulation_table(model)
    if table is not None:
        table.feed(rows)


def precompute_modulation(
    dit: nn.Module,
    sigmas: torch.Tensor,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[Any]],
) -> ModulationTable:
    """Compute the table for ``sigmas`` (every timestep the job will use) and install it on ``dit``.

    Each block's two base layers visit ``device`` once, one after the other (226 MB for Qwen-Image), and
    compute one row per timestep as the DiT would for a batch of one. Refuses layers that train.
    """
    problem = modulation_problem({"_class_name": type(dit).__name__, **dict(dit.config)}) or trained_modulation(dit)  # type: ignore[arg-type]
    if problem:
        raise ValueError(f"model.precompute_modulation: {problem}")
    hidden_dtype = _hidden_dtype(dit, device, autocast)
    as_dit_sees = _timestep_as_dit_sees(dit, hidden_dtype)
    keys = torch.unique(as_dit_sees(sigmas.cpu()))  # sorted
    blocks: Any = dit.transformer_blocks
    with torch.no_grad(), autocast():
        embedder: Any = dit.time_text_embed
        hidden = torch.empty(1, 1, device=device, dtype=hidden_dtype)
        with _on(embedder, device):
            temb = [embedder(key.view(1).to(device, hidden.dtype), hidden) for key in keys]
        rows: torch.Tensor | None = None
        for block_index, block in enumerate(blocks):
            for stream, name in enumerate(STREAMS):
                sequential = getattr(block, name)
                _, _, linear = _base_linear(sequential[1], sequential)
                weight, bias = _plain(linear.weight.to(device)), None if linear.bias is None else linear.bias.to(device)
                # One row at a time: the call a batch of one makes in training, so its values are bitwise the same.
                out = torch.cat([F.linear(sequential[0](t), weight, bias) for t in temb]).cpu()
                if rows is None:
                    rows = torch.empty((len(keys), len(blocks), len(STREAMS), out.shape[-1]), dtype=out.dtype)
                rows[:, block_index, stream] = out
    assert rows is not None, "a DiT without blocks"
    table = ModulationTable(keys, rows, as_dit_sees)
    table.install(dit)
    return table


def trained_modulation(dit: nn.Module) -> str | None:
    """What trains of the modulation's inputs and base layers (the time embedding, img_mod.1, txt_mod.1), or
    None: a table holds their outputs, so they must stay frozen."""
    embedder: Any = dit.time_text_embed
    if any(p.requires_grad for p in embedder.parameters()):
        return "time_text_embed trains (a LoRA target matches it); the table needs the time embedding frozen"
    blocks: Any = dit.transformer_blocks
    for block_index, block in enumerate(blocks):
        for name in STREAMS:
            _, _, linear = _base_linear(getattr(block, name)[1], getattr(block, name))
            if any(p.requires_grad for p in linear.parameters()):
                return (
                    f"transformer_blocks.{block_index}.{name}.1 trains; the table needs its base weights frozen (LoRA)"
                )
    return None


def _base_linear(layer: nn.Module, sequential: nn.Module) -> tuple[nn.Module, str, nn.Linear]:
    """(owner, attribute, Linear): the frozen Linear itself, or the ``base_layer`` of peft's LoRA wrapper."""
    base = getattr(layer, "base_layer", None)
    if isinstance(base, nn.Linear):
        return layer, "base_layer", base
    if isinstance(layer, nn.Linear):
        return sequential, "1", layer
    raise ValueError(f"expected a Linear (or a LoRA around one) as the modulation layer; got {type(layer).__name__}")


def _hidden_dtype(dit: nn.Module, device: torch.device, autocast: Callable[[], AbstractContextManager[Any]]) -> Any:
    """The dtype of the DiT's hidden states (``img_in``'s output), which its time embedding casts to."""
    img_in: Any = dit.img_in
    with torch.no_grad(), autocast(), _on(img_in, device):
        return img_in(torch.zeros(1, img_in.in_features, device=device, dtype=img_in.weight.dtype)).dtype


def _timestep_as_dit_sees(dit: nn.Module, hidden_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """sigma -> the value Qwen-Image's time embedding receives: cast to the latents' dtype by the caller
    (families._qwen_predict), then to the hidden states' (the DiT's forward); as float64 for lookups."""
    img_in: Any = dit.img_in
    latents_dtype = img_in.weight.dtype  # compute_dtype: the latents follow the base weights
    return lambda sigma: sigma.to(latents_dtype).to(hidden_dtype).double()


@contextlib.contextmanager
def _on(module: nn.Module, device: torch.device) -> Iterator[None]:
    """``module``'s own parameters on ``device`` for a moment (a small module: the embedder, ``img_in``)."""
    saved = [(p, p.data) for p in module.parameters()]
    for param, data in saved:
        param.data = data.to(device)
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """A quantized (torchao) weight dequantized once, so the row-by-row calls below do not each dequantize it
    again; a plain weight as it is. torchao's NF4 and affine tensors name the method differently."""
    for method in ("get_original_weight", "dequantize"):
        if type(weight).__module__.startswith("torchao.") and hasattr(weight, method):
            return getattr(weight, method)()
    return weight
