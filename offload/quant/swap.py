"""Swapping a quantized weight's contents (``torch.utils.swap_tensors``) after ``torch.compile`` traced it.

``swap_tensors`` refuses a tensor that any Python weak reference points to, and ``torch.compile`` leaves such
references on the parameters it traced in two cases, both where a compiled block has a graph break inside
(code dynamo cannot trace: a Triton kernel's launch path, a kernel library's autograd function):

- Dead: each break restarts dynamo's analysis of the frame, and the attempt it drops keeps a ``WeakIdRef`` to
  each parameter it saw (its fake-tensor describer, its tracing context) inside reference cycles that only
  Python's cycle collector frees (pytorch issue 186796). Collecting once frees them all.
- Live, for a while: the graphs of a block's pieces keep their compile's tracing context until their backward
  is compiled (AOTAutograd compiles it at its first call), and that context's weak-keyed tables hold the
  weights. A checkpoint's recompute, which compiles the grad-mode graphs inside the backward, releases its
  weights just before their backward runs, in that window.

So a swap that meets weak references first runs the cycle collector (only then: dynamo makes them only while
it compiles, so the steps after the first pay nothing but the check), and where live ones remain the caller
decides: an offload waits (the weight stays on the device until its next release, the end of the backward at
the latest, when those backward graphs are compiled), an onload cannot and raises.
"""

from __future__ import annotations

import gc
import weakref

import torch


def swappable(*tensors: torch.Tensor) -> bool:
    """Whether ``swap_tensors`` takes ``tensors`` now: no weak reference points to any, once the dead reference
    cycles that pointed weakly at them are collected.

    Call before changing any state of one's own: the collection may free autograd's saved tensors, whose
    release offloads weights (possibly one of ``tensors``' own) on the spot.
    """
    if not any(weakref.getweakrefs(t) for t in tensors):
        return True
    gc.collect()
    return not any(weakref.getweakrefs(t) for t in tensors)


def require_swappable(*tensors: torch.Tensor) -> None:
    """``swappable``, or a ``RuntimeError`` that says what holds the references."""
    if not swappable(*tensors):
        holders = sorted({type(ref).__name__ for t in tensors for ref in weakref.getweakrefs(t)})
        raise RuntimeError(
            f"cannot swap a quantized weight's contents: live weak references point to it ({', '.join(holders)}), "
            "e.g. a torch.compile whose backward graph is not compiled yet (offload/quant/swap.py)"
        )
