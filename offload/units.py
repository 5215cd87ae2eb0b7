"""Units: the groups of tensors that are onloaded and offloaded together, and how a model is cut into them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from offload.flat import FlatGroup
from offload.offloaders import TensorOffloader


@dataclass
class UnitPlan:
    """What discovery decided: a unit's name, the modules whose forward brackets it, and its tensors."""

    name: str
    hook_modules: list[nn.Module]
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    flat: bool = False  # copy the unit's host tensors as one span (block granularity)


class OffloadUnit:
    """A group of tensors onloaded together before a forward and offloaded together after it.

    The unit's onload/offload API is separate from the hooks that call it, so a scheduler can call it too
    (e.g. to prefetch the next unit while this one computes).
    """

    def __init__(self, name: str, offloaders: list[TensorOffloader]) -> None:
        self.name = name
        self.offloaders = offloaders
        # Flat groups whose members are all this unit's go through the group's batched calls; adapters on the
        # device need nothing; the rest one by one.
        groups = {id(o.group): o.group for o in offloaders if o.group is not None}
        mine = {id(o) for o in offloaders}
        self._groups: list[FlatGroup] = [g for g in groups.values() if all(id(m) in mine for m in g.members)]
        grouped = {id(m) for g in self._groups for m in g.members}
        self._singles = [o for o in offloaders if id(o) not in grouped and o.kind != "always_on_device"]
        self.nbytes = sum(o.nbytes for o in offloaders)
        self.index: int | None = None  # position in the recorded forward order
        self.backward_index: int | None = None  # position in the recorded backward order
        self.backward_step = -1  # the step whose backward last used this unit
        self.keep_for_backward = False  # the last unit of forward is the first of backward
        # False once the memory budget keeps every tensor of the unit on the device (decided between steps, once:
        # after the first, or after the second for a measured "auto" budget): its hooks then skip the
        # onload/offload bookkeeping.
        self.streams = True
        # False once the budget holds the unit's trainable weights from forward to backward: they copy into
        # memory of their own, and the unit takes no turn in its ring class.
        self.in_ring = True

    @property
    def streamed_bytes(self) -> int:
        """Bytes that move on each onload (tensors that are not permanently on the device)."""
        return sum(o.nbytes for o in self.offloaders if o.kind != "always_on_device")

    def onload(self) -> None:
        for group in self._groups:
            group.acquire_all()
        for offloader in self._singles:
            offloader.acquire()

    def offload(self) -> None:
        keep = self.keep_for_backward and torch.is_grad_enabled()
        for group in self._groups:
            group.release_all(keep)
        for offloader in self._singles:
            offloader.release(keep_if_saved=keep)

    def prefetch(self) -> None:
        """Start copying this unit's tensors on the copy stream; their users wait on its event."""
        for group in self._groups:
            group.prefetch_all()
        for offloader in self._singles:
            offloader.prefetch()

    @property
    def resident(self) -> bool:
        return all(o.resident for o in self.offloaders)

    def __repr__(self) -> str:
        kinds = sorted({o.kind for o in self.offloaders})
        return f"OffloadUnit({self.name!r}, tensors={len(self.offloaders)}, {self.nbytes} bytes, kinds={kinds})"


def _direct_tensors(module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    named: list[tuple[str, torch.Tensor]] = [
        (f"{prefix}{n}", p) for n, p in module._parameters.items() if p is not None
    ]
    named += [(f"{prefix}{n}", b) for n, b in module._buffers.items() if b is not None]
    return named


def _subtree_tensors(module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    named = []
    for mod_name, sub in module.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
        for name, tensor in _direct_tensors(sub, f"{mod_name}." if mod_name else ""):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                named.append((name, tensor))
    return named


def _nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def discover_units(
    model: nn.Module,
    split_threshold_bytes: int | None = None,
    granularity: str = "leaf",
    *,
    whole_units: tuple[str, ...] = (),
) -> list[UnitPlan]:
    """Cut ``model`` into units.

    With ``granularity="block"`` every child of an ``nn.ModuleList`` (the repeated layers of a transformer)
    is one unit whose tensors move in one copy; the rest is cut as below.

    Without a threshold every leaf module with parameters or buffers is a unit, and the parameters and
    buffers of non-leaf modules ("orphans") form one unit per owner, onloaded around the owner's forward and
    its parent's (a parent may use a child's parameter directly). With ``split_threshold_bytes`` a module at
    or under the threshold is one unit with its whole subtree; larger ones are split into their children.
    A module named in ``whole_units`` is one unit with its whole subtree, moved in one copy, in any case.
    """
    plans: list[UnitPlan] = []
    visited: set[int] = set()

    def visit(module: nn.Module, prefix: str, parent: nn.Module) -> None:
        if id(module) in visited:  # a module registered twice is one unit; its hooks fire on every call
            return
        visited.add(id(module))
        children = list(module.named_children())
        if prefix.rstrip(".") in whole_units:
            subtree = _subtree_tensors(module, prefix)
            if subtree:
                plans.append(UnitPlan(prefix.rstrip("."), [module], subtree, flat=True))
            return
        if granularity == "block" and isinstance(parent, nn.ModuleList) and parent is not module:
            subtree = _subtree_tensors(module, prefix)
            if subtree:
                plans.append(UnitPlan(prefix.rstrip("."), [module], subtree, flat=True))
            return
        if split_threshold_bytes is not None:
            subtree = _subtree_tensors(module, prefix)
            if subtree and (not children or _nbytes(subtree) <= split_threshold_bytes):
                plans.append(UnitPlan(prefix.rstrip(".") or "<root>", [module], subtree))
                return
        direct = _direct_tensors(module, prefix)
        if not children:
            if direct:
                plans.append(UnitPlan(prefix.rstrip(".") or "<root>", [module], direct))
            return
        if direct:
            hooks = [module] if parent is module else [module, parent]
            plans.append(UnitPlan(f"{prefix.rstrip('.') or '<root>'} (own tensors)", hooks, direct))
        for name, child in children:
            visit(child, f"{prefix}{name}.", module)

    visit(model, "", model)
    return plans
