"""Units: the groups of tensors that are onloaded and offloaded together, and how a model is cut into them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from offload.offloaders import TensorOffloader


@dataclass
class UnitPlan:
    """What discovery decided: a unit's name, the modules whose forward brackets it, and its tensors."""

    name: str
    hook_modules: list[nn.Module]
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)


class OffloadUnit:
    """A group of tensors onloaded together before a forward and offloaded together after it.

    The unit's onload/offload API is separate from the hooks that call it, so a scheduler can call it too
    (e.g. to prefetch the next unit while this one computes).
    """

    def __init__(self, name: str, offloaders: list[TensorOffloader]) -> None:
        self.name = name
        self.offloaders = offloaders
        self.nbytes = sum(o.nbytes for o in offloaders)

    def onload(self) -> None:
        for offloader in self.offloaders:
            offloader.acquire()

    def offload(self) -> None:
        for offloader in self.offloaders:
            offloader.release()

    @property
    def resident(self) -> bool:
        return all(o.resident for o in self.offloaders)

    def __repr__(self) -> str:
        kinds = sorted({o.kind for o in self.offloaders})
        return f"OffloadUnit({self.name!r}, tensors={len(self.offloaders)}, {self.nbytes} bytes, kinds={kinds})"


def _direct_tensors(module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    named = [(f"{prefix}{n}", p) for n, p in module._parameters.items() if p is not None]
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


def discover_units(model: nn.Module, split_threshold_bytes: int | None = None) -> list[UnitPlan]:
    """Cut ``model`` into units.

    Without a threshold every leaf module with parameters or buffers is a unit, and the parameters and
    buffers of non-leaf modules ("orphans") form one unit per owner, onloaded around the owner's forward and
    its parent's (a parent may use a child's parameter directly). With ``split_threshold_bytes`` a module at
    or under the threshold is one unit with its whole subtree; larger ones are split into their children.
    """
    plans: list[UnitPlan] = []
    visited: set[int] = set()

    def visit(module: nn.Module, prefix: str, parent: nn.Module) -> None:
        if id(module) in visited:  # a module registered twice is one unit; its hooks fire on every call
            return
        visited.add(id(module))
        children = list(module.named_children())
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
