"""Tensor layout: host and device copies keep a weight's strides.

A weight stored transposed (a checkpoint converted from another layout, a tied ``weight.t()``) must reach
the kernels with the same strides as without offload: a contiguous copy holds the same values, but
matmul then picks another kernel and the results drift in the last bits. A copy of a dense, non-overlapping
tensor (any permutation of a contiguous one) keeps its strides in ``numel`` elements; any other layout (a
slice with gaps, an expanded view) is copied contiguous, as ``clone(memory_format=contiguous)`` would.
"""

from __future__ import annotations

import torch


def dense_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s strides when its elements fill ``numel`` slots exactly; otherwise contiguous strides."""
    if tensor.is_contiguous():
        return _contiguous(tensor.shape)
    expected = 1
    for dim in sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), tensor.size(d))):
        if tensor.size(dim) != 1 and tensor.stride(dim) != expected:
            return _contiguous(tensor.shape)
        expected *= tensor.size(dim)
    return tuple(tensor.stride())


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def shaped_like(flat: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """View ``numel`` elements of ``flat`` (already of ``tensor``'s dtype) with ``tensor``'s shape and layout."""
    return flat.as_strided(tensor.shape, dense_strides(tensor))
