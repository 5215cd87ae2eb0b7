"""A quantized tensor as the engine stores and sends it: torchao's inner tensors packed into one payload.

A torchao quantized weight (``NF4Tensor``, ``Int8Tensor``) keeps its data in inner tensors (codes, scales);
the engine packs them, each aligned, into one ``uint8`` buffer (``QuantizedPayload``), which is its pinned
host copy, what crosses the link and what its ring slot holds. Everything here reads a tensor's layout
only: torchao itself is never imported (a tensor is recognised by its type's module).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from offload.arena import aligned


def is_quantized(tensor: torch.Tensor) -> bool:
    """A torchao quantized tensor (a traceable wrapper subclass whose data lives in inner tensors)."""
    return type(tensor).__module__.startswith("torchao.") and hasattr(tensor, "__tensor_flatten__")


def inner_tensors(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The quantized tensor's inner tensors (codes, scales, ...) by attribute name."""
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]  # a traceable tensor subclass
    return [(name, getattr(tensor, name)) for name in names]


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` as stored and sent: its packed payload when quantized, else ``numel x size``."""
    if not is_quantized(tensor):
        return max(1, tensor.numel()) * tensor.element_size()
    return sum(aligned(t.numel() * t.element_size()) for _, t in inner_tensors(tensor))


def link_bytes(name: str, tensor: torch.Tensor) -> int:
    """``plan_memory``'s size function: a quantized weight takes its stored bytes in the arena and the ring."""
    return stored_bytes(tensor)


class QuantizedPayload:
    """A quantized tensor's inner tensors packed into one ``uint8`` buffer, and views that unpack it.

    Args:
        tensor: the torchao tensor (its inner tensors are copied in), or a meta placeholder of one (only its
            layout is read; the buffer is filled elsewhere).
        buffer: ``stored_bytes(tensor)`` bytes (a pinned arena allocation).
    """

    def __init__(self, tensor: torch.Tensor, buffer: torch.Tensor) -> None:
        _, self.context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        self.kind = type(tensor)
        self.shape, self.stride = tensor.shape, tensor.stride()
        self.layout: list[tuple[str, int, int, torch.Size, torch.dtype]] = []  # name, offset, bytes, shape, dtype
        offset = 0
        for name, inner in inner_tensors(tensor):
            nbytes = inner.numel() * inner.element_size()
            self.layout.append((name, offset, nbytes, inner.shape, inner.dtype))
            offset += aligned(nbytes)
        self.buffer = buffer
        if tensor.is_meta:  # a placeholder: its payload is filled by the engine's ``initialize`` (on_load.py)
            return
        for (_, inner), view in zip(inner_tensors(tensor), self.views(buffer).values(), strict=True):
            view.copy_(inner)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inner tensors as views of ``buffer`` (the host payload or its device copy)."""
        return {name: buffer[at : at + n].view(dtype).view(shape) for name, at, n, shape, dtype in self.layout}

    def tensor_over(self, buffer: torch.Tensor, *, clone: bool = False) -> torch.Tensor:
        """A frozen parameter of the same torchao type over ``buffer``'s bytes (cloned: its own memory)."""
        inner = {k: v.clone() if clone else v for k, v in self.views(buffer).items()}
        context = self.context
        meta = context.get("tensor_meta") if isinstance(context, dict) else None
        # NF4Tensor records its device in its metadata (a named tuple or, in newer torchao, a dataclass).
        if meta is not None and hasattr(meta, "_replace"):
            context = {**context, "tensor_meta": meta._replace(device=buffer.device)}
        elif meta is not None and dataclasses.is_dataclass(meta) and not isinstance(meta, type):
            context = {**context, "tensor_meta": dataclasses.replace(meta, device=buffer.device)}
        rebuilt = self.kind.__tensor_unflatten__(inner, context, self.shape, self.stride)  # type: ignore[attr-defined]
        return nn.Parameter(rebuilt, requires_grad=False)
