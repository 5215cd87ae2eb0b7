"""Onload before backward, offload after backward, driven by autograd's saved tensors.

While a unit's forward runs, autograd saves the tensors its backward will need. For a managed weight (or a
view of one, as ``F.linear`` saves ``weight.t()``) we save a small token instead of the device copy, so the
copy can be dropped after forward. When the backward node unpacks the token, the weight is onloaded again
("onload before backward"); when autograd frees the token after the node ran, the weight is offloaded
("offload after backward"). Compared with module backward hooks this needs no wrapper around outputs (so
in-place ops on outputs work), fires exactly when a weight is needed (a module called twice, a shared
weight, gradient checkpointing in both modes), and never fires for a forward without backward.

A node may drop its saved tensors before its work is done: a ``torch.compile``d region's backward
(AOTAutograd's ``CompiledFunction``) unpacks them all, then clears them to free activations early, and only
then runs its graph. Releasing the weight at that point would offload it mid-node: its ring slot freed before
the node's kernels are queued (the next copy into the slot could overtake them), and a quantized weight's
parameter object, which the node still holds, swapped back to its host contents. So an unpacked weight is
also held by the node that unpacked it, and let go once that node has run (a post-hook), as it would be after
an eager node.

Other saved tensors pass through unchanged: to an outer hook if one is active (checkpointing installs one)
or kept as a detached alias with autograd's usual in-place modification check.
"""

from __future__ import annotations

from collections.abc import Callable
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
        offloader = self.offloader
        weight = offloader.ensure_resident()
        node = torch._C._current_autograd_node()
        if node is not None:
            _hold_while_running(node, offloader)
        if offloader.on_backward_use is not None:
            offloader.on_backward_use(offloader)
        if self.view is None:
            return weight
        size, stride, offset = self.view
        return weight.as_strided(size, stride, weight.storage_offset() + offset)

    def __del__(self) -> None:
        # Offload after backward: autograd frees saved tensors once the node that needed them has run.
        self.offloader.token_released()


def _hold_while_running(node: Any, offloader: TensorOffloader) -> None:
    """Keep ``offloader``'s weight on the device until the compiled region's backward ``node`` unpacking it has
    run, although the node drops its saved tensors first (module docstring): the release then comes after the
    node's work is queued. Other nodes release their saved tensors only after they ran: nothing to do (and no
    per-tensor host work added to them)."""
    forward_class = getattr(node, "_forward_cls", None)  # a Python autograd.Function's node: its Function
    if getattr(forward_class, "_aot_id", None) is None:  # not AOTAutograd's CompiledFunction
        return
    held: list[TensorOffloader] | None = getattr(node, "ferry_held", None)
    if held is None:
        held = node.ferry_held = []

        def release(grad_inputs: Any, grad_outputs: Any) -> None:
            for each in held:
                each.release()  # offloads now unless a token or another hold still needs the weight
            held.clear()

        node.register_hook(release)
    offloader.holds += 1
    held.append(offloader)


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
    """Saved-tensor hooks that stand tokens in for managed weights; pushed around each unit's forward.

    Only weights that stream are routed (``offloaders``: id -> offloader, kept up to date by the manager): a
    weight that never leaves the device (adapters trained there, a unit the memory budget keeps) is saved
    as autograd saves any tensor, with no token to count, unpack or release. Every saved tensor of a unit's
    forward passes through ``pack`` (a DiT block saves hundreds a step), so it does as little as it can.
    """

    def __init__(self, offloaders: dict[int, TensorOffloader]) -> None:
        self.offloaders = offloaders
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

    def stop_routing(self, offloader_ids: set[int]) -> None:
        """Save these weights as plain tensors from now on (they stay on the device for good)."""
        for key in offloader_ids:
            self.offloaders.pop(key, None)


def _hooks(
    router: SavedTensorRouter, outer: tuple[Callable, Callable] | None
) -> torch.autograd.graph.saved_tensors_hooks:
    """The hooks context. ``pack`` and ``unpack`` are closures, not bound methods of the context: a context
    that held its own method would be a reference cycle, and through ``outer`` it would keep gradient
    checkpointing's frames (and the block inputs they save) alive until the garbage collector ran.

    A tensor that is not a routed weight goes to the enclosing hook (gradient checkpointing installs one)
    as it is, and its packed value comes back to that hook's unpack: anything packed that is not one of our
    tokens is the outer hook's.
    """
    offloaders = router.offloaders
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(tensor: torch.Tensor) -> Any:
        offloader = offloaders.get(id(tensor))
        if offloader is not None and offloader.tensor is tensor and offloader.pending is not None:
            return SavedWeight(offloader, None)
        base = tensor._base
        if base is not None:
            offloader = offloaders.get(id(base))
            if offloader is not None and offloader.tensor is base and offloader.pending is not None:
                offset = int(tensor.storage_offset() - base.storage_offset())
                return SavedWeight(offloader, (tensor.size(), tensor.stride(), offset))
        if outer_pack is not None:
            return outer_pack(tensor)
        return SavedActivation(tensor)

    def unpack(packed: Any) -> torch.Tensor:
        if outer_unpack is None or type(packed) is SavedWeight:
            return packed.unpack()
        return outer_unpack(packed)

    pack.ferry_router = router  # type: ignore[attr-defined]
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
