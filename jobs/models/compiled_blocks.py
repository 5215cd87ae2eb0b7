"""``training.compile``: torch.compile of a model's repeated block, once for all its layers (regional compilation).

A decoder stack runs one class of layer N times. Every layer's ``forward`` here calls one ``torch.compile`` wrapper
of that class's function with itself as ``self`` (torchtitan compiles per block, diffusers calls it
``compile_repeated_blocks``). Dynamo caches graphs per code object, and with the layer's submodules and parameters
taken as graph inputs (``inline_inbuilt_nn_modules``, torch's default) its guards check the parameters' shapes,
dtypes and strides, not which layer they belong to nor where their storage lies: the layers share the graphs, and
the compile takes one block's time, not the model's.

What it has to live with:

- The offload engine swaps each streamed parameter's storage (``.data``) between its host copy and a ring slot. The
  parameter objects stay the same; only their data pointers change, which no guard reads. The engine's hooks are on
  the block module itself with ``offload.granularity: block``, outside the compiled ``forward`` (only ``forward`` is
  compiled, not ``__call__``); leaf units would put hooks inside the compiled region, so a rule refuses that pairing.
- The engine's saved-tensor hooks are active around a block's forward: the compiled graph's saved tensors (the
  frozen weights among them) pass through them as any autograd node's do, so backward re-onloads streamed weights;
  the compiled backward drops its saved tensors before it runs its graph, and the engine then holds the weights it
  unpacked until the node has run (offload/saved_tensors.py).
- Quantized frozen weights (``model.quantize``): an NF4 weight dequantized on arrival is a plain tensor in the
  graph; torchao's ``NF4Tensor`` and ``Int8Tensor`` are traced as tensor subclasses, guarded by shape and dtype like
  any parameter. Either way every layer shares the graphs.
- Ferry's reentrant checkpoint (jobs/recompute/checkpoint.py) runs a layer under ``no_grad`` and again with grad in
  the recompute: grad mode is guarded, so a checkpointed stack compiles two forward graphs (and one backward), for
  any number of layers. Without checkpointing, the first layer's input needs no gradient and the others' do: two
  graphs as well.
- LoRA: peft's layers inside the block are traced like any module.
- Graph breaks inside a block (code dynamo cannot trace: a Triton kernel's launch path, some kernel libraries'
  autograd functions) split it into more graphs, and each restarts dynamo's analysis: the attempt it drops
  leaves weak references on the weights it saw, which ``torch.utils.swap_tensors`` refuses; the engine
  collects them before it swaps a quantized weight, and an offload waits while a compile still holds some
  (offload/quant/swap.py). Ferry's own int8 dequantization takes its traceable path inside a compiled region
  (offload/quant/int8_linear.py).

The compiled artifacts go to the inductor cache (``use_inductor_cache``): a later job of the same shape in the same
service reuses them instead of compiling again.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)
BACKEND = "inductor"  # torch.compile's default; tests use "aot_eager" (the same graphs, no code generation)
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"  # torch reads the inductor (and AOTAutograd) cache's folder here


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of ``model``'s ``nn.ModuleList``s whose class occurs at least twice in their list (a decoder's
    layers, a DiT's blocks), outermost first; a block inside another one found is not listed again."""
    found: list[nn.Module] = []
    inside: set[int] = set()  # every module under a block already found
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        classes = [type(child) for child in module]
        for child in module:
            if classes.count(type(child)) >= 2 and id(child) not in inside:
                found.append(child)
                inside.update(id(m) for m in child.modules())
    return found


@dataclass
class CompiledBlocks:
    """The blocks whose ``forward`` runs compiled, and what compiling them has cost so far in this process.

    ``graphs`` and ``compile_seconds`` are dynamo's process-wide counters since this object was made: every
    compile in the process counts, which in a job's process is this model's.
    """

    blocks: list[nn.Module]
    backend: str
    cache_dir: Path | None = None
    originals: list[Any] = field(default_factory=list)  # each block's instance forward before (None: its class's)
    _graphs_before: int = field(init=False, default_factory=lambda: _unique_graphs())
    _seconds_before: float = field(init=False, default_factory=lambda: _compile_seconds())

    @property
    def graphs(self) -> int:
        """Graphs dynamo captured since: bounded by the modes a block runs in, not by the number of layers."""
        return _unique_graphs() - self._graphs_before

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling since (tracing, AOTAutograd, code generation; the backward's too)."""
        return _compile_seconds() - self._seconds_before

    def summary(self) -> str:
        """The job event's message, once the first step has compiled what the steps run."""
        names = sorted({type(b).__name__ for b in self.blocks})
        cache = f"; inductor cache {self.cache_dir}" if self.cache_dir is not None else ""
        return (
            f"training.compile: {len(self.blocks)} {'/'.join(names)} blocks share one compiled forward "
            f"({self.backend}): {self.graphs} graphs, compiled in {self.compile_seconds:.1f} s{cache}"
        )

    def remove(self) -> None:
        """The blocks run their eager ``forward`` again (their class's, or the one they had on the instance)."""
        for block, original in zip(self.blocks, self.originals, strict=True):
            block.__dict__.pop("forward", None)
            if original is not None:
                block.forward = original


def compile_repeated_blocks(
    model: nn.Module, *, backend: str | None = None, cache_dir: Path | None = None
) -> CompiledBlocks | None:
    """Make every repeated block of ``model`` (``repeated_blocks``) run its class's ``forward`` through one
    ``torch.compile`` wrapper per class; None (and a warning) when the model has no repeated blocks.

    Call after the modules inside the blocks are final (fused kernels, LoRA): compilation itself happens at the
    first call, and traces whatever the block holds then.

    Example:
        >>> compiled = compile_repeated_blocks(model)  # one graph for all 28 decoder layers
        >>> loss = model(**batch).loss; loss.backward()
        >>> compiled.summary()
    """
    blocks = repeated_blocks(model)
    if not blocks:
        log.warning(
            "training.compile: %s has no repeated blocks (nn.ModuleList); it runs eagerly", type(model).__name__
        )
        return None
    chosen = backend or BACKEND
    compiled = CompiledBlocks([], chosen, cache_dir)  # counters from before the first compile (at the first call)
    wrappers: dict[Any, Any] = {}  # the function compiled -> its one torch.compile wrapper
    for block in blocks:
        function, checkpoints = _plain_forward(block)
        if function is None:
            log.warning("training.compile: %s has a forward of its own (%r); it runs eagerly", type(block).__name__,
                        block.__dict__["forward"])  # fmt: skip
            continue
        if function not in wrappers:
            wrappers[function] = torch.compile(function, backend=chosen)
        compiled.blocks.append(block)
        compiled.originals.append(block.__dict__.get("forward"))
        block.forward = _block_forward(block, wrappers[function], checkpoints)
    log.info(
        "training.compile: %d blocks (%s), backend %s",
        len(compiled.blocks),
        sorted({type(b).__name__ for b in blocks}),
        chosen,
    )
    return compiled if compiled.blocks else None


def use_inductor_cache(directory: Path) -> Path:
    """Keep inductor's compiled code (and AOTAutograd's) in ``directory``, the service's cache for its jobs, so a
    job compiling a model of the same shape as an earlier one finds it there. torch reads the folder from the
    environment (``TORCHINDUCTOR_CACHE_DIR``) when it first compiles: call before that."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_VARIABLE] = str(directory)
    return directory


def _plain_forward(block: nn.Module) -> tuple[Any, bool]:
    """The function to compile for ``block``, and whether it sits under transformers' checkpointing wrapper; (None,
    False) for a block whose instance ``forward`` is not a method of its own (another library's wrapper).

    transformers (from 5.18) replaces each decoder layer class's ``forward`` with ``forward_with_checkpointing``,
    which calls ``_gradient_checkpointing_func`` around the original; the original is what runs in both the
    checkpoint's forward and its recompute, so it is what is compiled, and the wrapper's choice is made again
    outside it (``_block_forward``). A forward bound on the instance (a kernel library's patch) is compiled as its
    function, once for every block that has it."""
    own = block.__dict__.get("forward")
    if own is not None:
        bound_here = getattr(own, "__self__", None) is block and hasattr(own, "__func__")
        return (own.__func__, False) if bound_here else (None, False)
    forward: Any = type(block).forward
    if forward.__code__.co_name == "forward_with_checkpointing" and hasattr(forward, "__wrapped__"):
        return forward.__wrapped__, True
    return forward, False


def _block_forward(block: nn.Module, compiled: Any, checkpoints: bool) -> Any:
    """``block``'s instance ``forward``: the compiled function with the block as ``self``; for a layer under
    transformers' checkpointing wrapper, the wrapper's choice first (Ferry's training passes no KV cache, the one
    thing that wrapper also changes)."""
    if not checkpoints:
        return functools.partial(compiled, block)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if getattr(block, "gradient_checkpointing", False) and block.training and torch.is_grad_enabled():
            checkpoint: Any = block._gradient_checkpointing_func  # Ferry's (jobs/recompute/checkpoint.py)
            return checkpoint(functools.partial(compiled, block, **kwargs), *args)
        return compiled(block, *args, **kwargs)

    return forward


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_seconds() -> float:
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
