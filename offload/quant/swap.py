"""Swapping a quantized weight's contents (``torch.utils.swap_tensors``) after ``torch.compile`` traced it.

``swap_tensors`` refuses a tensor that any Python weak reference points to. Dynamo leaves such references on
the parameters it traced when a trace is thrown away and restarted, which a graph break inside the compiled
region causes (each break restarts the analysis of the frame): the dropped attempt's fake-tensor describer and
tracing context keep a ``WeakIdRef`` to each parameter they saw, inside reference cycles that only Python's
cycle collector frees (pytorch issue 186796). Until it runs, the engine could not swap that weight between
its host and device contents; a compiled block with a break inside (a Triton kernel dynamo cannot trace, a
fused-kernel library's autograd function) then failed at its first offload.

So a swap that meets weak references first runs the cycle collector once, which frees these (dynamo makes
them only while it compiles: after one collection the next swaps find none and pay nothing but the check). A
weak reference that a collection does not free belongs to a live owner, which would see the contents change
under it: that is an error, as ``swap_tensors``'s own is, with what holds it.
"""

from __future__ import annotations

import gc
import logging
import weakref

import torch

log = logging.getLogger(__name__)


def free_compiler_weakrefs(*tensors: torch.Tensor) -> None:
    """Make ``tensors`` swappable: collect the dead reference cycles that still point weakly at any of them.

    Call before changing any state of one's own: the collection may free autograd's saved tensors, whose
    release offloads weights (possibly one of ``tensors``' own) on the spot.

    Raises:
        RuntimeError: when a live object keeps a weak reference to one of them after the collection.
    """
    if not any(weakref.getweakrefs(t) for t in tensors):
        return
    collected = gc.collect()
    log.debug("weak references on a swapped weight: the cycle collector freed %d objects", collected)
    alive = [type(ref).__name__ for t in tensors for ref in weakref.getweakrefs(t)]
    if alive:
        raise RuntimeError(
            f"cannot swap a quantized weight's contents: live weak references point to it ({', '.join(alive)}); "
            "something other than a finished torch.compile trace keeps them (offload/quant/swap.py)"
        )
