"""Onload before backward, offload after backward, driven by autograd's saved tensors.

While a unit's forward runs, autograd saves the tensors its backward will need. For a managed weight (or a
view of one, as ``F.linear`` saves ``weight.t()``) we save a small token instead of the device copy, so the
copy can be dropped after forward. When the backward node unpacks the token, the weight is onloaded again
("onload before backward"); when autograd frees the token after the node ran, the weight is offloaded
("offload after backward"). Compared with module backward hooks this needs no wrapper around outputs (so
in-place ops on outputs work), fires exactly when a weight is needed (a module called twice, a shared
weight, gradient checkpointing in both modes), and never fires for a forward without backward.

Other saved tensors pass through unchanged: to an outer hook if one is active (checkpointing installs one)
or kept as a detached alias with autograd's usual in-place modification check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from offload.offloaders import TensorOffloader


class SavedWeight:
    """Stands in for a managed weight (or a view of it) inside the autograd graph."""

    __slots__ = ("offloader", "view")

    def __init__(self, offloader: TensorOffloader, view: tuple[torch.Size, tuple[int, ...], int] | None) -> None:
        self.offloader = offloader
        self.view = view
        offloader.token_packed()

    def unpack(self) -> torch.Tensor:
        """Onload before backward: the device copy (re-made if it was dropped after forward)."""
        weight = self.offloader.ensure_resident()
        if self.offloader.on_backward_use is not None:
            self.offloader.on_backward_use(self.offloader)
        if self.view is None:
            return weight
        size, stride, offset = self.view
        return weight.as_strided(size, stride, weight.storage_offset() + offset)

    def __del__(self) -> None:
        # Offload after backward: autograd frees saved tensors once the node that needed them has run.
        self.offloader.token_released()


class SavedActivation:
    """Any other saved tensor, kept as autograd would keep it, with its in-place modification check."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        # detach(): returning the tensor itself would tie an output to its own grad_fn (a reference cycle
        # that frees activations only at garbage collection). The alias shares the version counter.
        self.tensor = tensor.detach()
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{self.tensor.type()} {list(self.tensor.shape)}] is at version "
                f"{self.tensor._version}; expected version {self.version} instead."
            )
        return self.tensor


class SavedTensorRouter:
    """Saved-tensor hooks that stand tokens in for managed weights; pushed around each unit's forward."""

    def __init__(self, offloaders: Mapping[int, TensorOffloader]) -> None:
        self._offloaders = offloaders
        self._contexts: list[Any | None] = []

    def enter(self) -> None:
        """Install the hooks unless ours are already the innermost (nested units share them)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and getattr(top[0], "ferry_router", None) is self:
            self._contexts.append(None)
            return
        context = _hooks(self, outer=top)
        context.__enter__()
        self._contexts.append(context)

    def exit(self) -> None:
        context = self._contexts.pop()
        if context is not None:
            context.__exit__(None, None, None)

    def pack(self, tensor: torch.Tensor, outer: tuple[Callable, Callable] | None) -> Any:
        offloader = self._offloaders.get(id(tensor))
        if offloader is not None and offloader.tensor is tensor and offloader.resident:
            return SavedWeight(offloader, None)
        base = tensor._base
        if base is not None:
            offloader = self._offloaders.get(id(base))
            if offloader is not None and offloader.tensor is base and offloader.resident:
                offset = int(tensor.storage_offset() - base.storage_offset())
                return SavedWeight(offloader, (tensor.size(), tensor.stride(), offset))
        if outer is not None:
            return _Outer(outer[1], outer[0](tensor))
        return SavedActivation(tensor)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.unpack()


class _Outer:
    """A tensor packed by an enclosing hook (e.g. gradient checkpointing's), unpacked by it too."""

    __slots__ = ("packed", "unpack_hook")

    def __init__(self, unpack_hook: Callable, packed: Any) -> None:
        self.unpack_hook = unpack_hook
        self.packed = packed

    def unpack(self) -> torch.Tensor:
        return self.unpack_hook(self.packed)


def _hooks(
    router: SavedTensorRouter, outer: tuple[Callable, Callable] | None
) -> torch.autograd.graph.saved_tensors_hooks:
    """The hooks context. The pack function is a closure, not a bound method of the context: a context that
    held its own method would be a reference cycle, and through ``outer`` it would keep gradient
    checkpointing's frames (and the block inputs they save) alive until the garbage collector ran."""

    def pack(tensor: torch.Tensor) -> Any:
        return router.pack(tensor, outer)

    pack.ferry_router = router  # type: ignore[attr-defined]
    return torch.autograd.graph.saved_tensors_hooks(pack, router.unpack)
