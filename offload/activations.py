"""Activation offload: the inputs gradient checkpointing keeps, held in pinned host memory until the recompute.

With checkpointing, what a step keeps on the device from forward to backward is each checkpointed block's
input: layers x tokens x hidden. At 32k tokens on a 64-layer, 5120-wide model that is 21 GiB of bf16, more
than the weights' whole streaming window, so the sequence length is bound by the card. Here those inputs
leave the device as they are saved and come back for their block's recompute, so it is bound by host memory.

How: a checkpoint function wrapped by ``ActivationOffload.wrap`` runs under ``saving()``, saved-tensor hooks
that see exactly what the checkpoint saves for backward (torch's reentrant checkpoint saves its inputs when
its forward returns; the block inside runs under ``no_grad`` and saves nothing, and the engine's own hooks
for weights stay innermost). Each such tensor is copied device -> host on the engine's device->host stream
after the compute stream has produced it (an event, no host sync), into a host buffer from a pinned arena
planned for them; its device memory goes back to the allocator once that copy is done (``record_stream``).
Backward unpacks them last first: unpacking one copies it back (or waits for its prefetch) and starts the
host -> device copy of the one saved before it, on the engine's copy stream, so the next block's input
arrives while this block recomputes and backpropagates, beside the weights' prefetches. The values are the
same bytes, so gradients are bitwise those of training without it (tests/offload/test_activations.py).

Host buffers are reused across steps: a buffer goes back to its free list when autograd frees the saved
tensor, and the device->host copy that reuses it waits for the last copy that read it. Non-reentrant
checkpointing installs its own saved-tensor hooks inside the block and is not offloaded by this.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from offload.arena import PinnedArenaPool
from offload.devices import can_pin_memory
from offload.layout import shaped_like
from offload.saved_tensors import SavedActivation
from offload.transfers import CopyEngine, PendingCopy

MIN_BYTES = 1 << 10  # smaller saved tensors (a mask, a scalar) stay where they are: a copy costs more than they do


class _HostBuffer:
    """Pinned bytes for one saved input, with the event of the last device copy that read them."""

    __slots__ = ("flat", "read_done")

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.read_done: torch.cuda.Event | None = None


class SavedInput:
    """A checkpointed input on the host: its buffer, its layout, and its way back to the device."""

    __slots__ = ("__weakref__", "buffer", "generation", "host", "index", "offload", "on_device", "stored")

    def __init__(self, offload: ActivationOffload, tensor: torch.Tensor, buffer: _HostBuffer, index: int) -> None:
        self.offload = offload
        self.buffer = buffer
        self.generation, self.index = offload.generation, index  # which step saved it, in which order
        flat = buffer.flat[: tensor.numel() * tensor.element_size()].view(tensor.dtype)
        self.host = shaped_like(flat, tensor)  # the tensor's strides kept: the recompute runs the same kernels
        self.stored = offload.copies.to_host_async(tensor, self.host)  # the D2H's event (None on the CPU)
        self.on_device: PendingCopy | None = None

    def prefetch(self) -> None:
        """Start the copy back on the copy stream (a no-op once started)."""
        if self.on_device is not None:
            return
        copies = self.offload.copies
        if copies.h2d_stream is None:  # no copy stream (prefetch=0): the copy goes on the compute stream
            self._copy_on_compute_stream()
            return
        # On the copy stream, after the device -> host copy that filled the buffer (``after``).
        self.on_device = copies.to_device(self.host, prefetch=True, after=self.stored)
        self.buffer.read_done = self.on_device.event

    def _copy_on_compute_stream(self) -> None:
        copies = self.offload.copies
        if self.stored is not None:  # after the copy that filled the buffer (a device-side wait)
            torch.cuda.current_stream(copies.device).wait_event(self.stored)
        self.on_device = copies.to_device(self.host)
        if copies.device.type == "cuda":
            self.buffer.read_done = torch.cuda.Event()
            self.buffer.read_done.record(torch.cuda.current_stream(copies.device))

    def unpack(self) -> torch.Tensor:
        if self.on_device is None:
            self._copy_on_compute_stream()
        assert self.on_device is not None
        tensor = self.offload.copies.wait(self.on_device)
        self.offload.unpacked(self)
        return tensor

    def __del__(self) -> None:
        # Autograd frees the saved tensor after its node ran (or with a graph never backpropagated).
        self.offload.release(self.buffer)


class ActivationOffload:
    """Checkpointed inputs kept in (pinned) host memory from forward to their recompute (module docstring).

    Args:
        copies: the engine's copy engine (its streams, events and byte counters).
        planned_bytes: host bytes planned for the inputs of one step (the job's estimate); the arena grows
            past it if a step saves more.
        pin: page-locked host memory.
        min_bytes: saved tensors smaller than this stay on the device.

    Example:
        >>> activations = manager.activations  # OffloadOptions(offload_activations=True)
        >>> layer._gradient_checkpointing_func = activations.wrap(layer._gradient_checkpointing_func)
    """

    def __init__(self, copies: CopyEngine, *, planned_bytes: int = 0, pin: bool = True, min_bytes: int = MIN_BYTES):
        self.copies = copies
        self.device = copies.device
        self.min_bytes = min_bytes
        self.arena = PinnedArenaPool(planned_bytes, pin=pin and can_pin_memory())
        self._free: dict[int, list[_HostBuffer]] = {}  # bytes -> buffers no saved input holds
        self._saved: list[Any] = []  # this step's saved inputs (weak references), in the order they were saved
        self.generation = 0  # steps ended (end_step)
        self.offloaded_bytes = 0  # device -> host bytes of saved inputs, since creation
        self.held_bytes = 0  # host bytes saved inputs hold now
        self.peak_held_bytes = 0

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Saved-tensor hooks that send what is saved inside to the host (put around a checkpoint call)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def wrap(self, checkpoint: Callable[..., Any]) -> Callable[..., Any]:
        """``checkpoint`` (a gradient checkpointing function) with its saved inputs offloaded."""
        if getattr(checkpoint, "ferry_activations", None) is self:
            return checkpoint

        @functools.wraps(checkpoint)
        def offloaded(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return checkpoint(*args, **kwargs)
            with self.saving():
                return checkpoint(*args, **kwargs)

        offloaded.ferry_activations = self  # type: ignore[attr-defined]
        offloaded.__wrapped__ = checkpoint
        return offloaded

    def _pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device != self.device or nbytes < self.min_bytes or isinstance(tensor, nn.Parameter):
            return SavedActivation(tensor)
        saved = SavedInput(self, tensor, self._buffer(nbytes), len(self._saved))
        self._saved.append(_weak(saved))
        self.offloaded_bytes += nbytes
        return saved

    def _buffer(self, nbytes: int) -> _HostBuffer:
        free = self._free.get(nbytes)
        buffer = free.pop() if free else _HostBuffer(self.arena.allocate((nbytes,), torch.uint8))
        if buffer.read_done is not None and self.copies.d2h_stream is not None:
            # Its last copy back to the device may still be reading it: the copy that refills it waits.
            self.copies.d2h_stream.wait_event(buffer.read_done)
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return buffer

    def release(self, buffer: _HostBuffer) -> None:
        nbytes = buffer.flat.numel()
        self.held_bytes -= nbytes
        self._free.setdefault(nbytes, []).append(buffer)

    def unpacked(self, saved: SavedInput) -> None:
        """Backward reached ``saved``: prefetch the input saved just before it, which backward needs next."""
        if saved.generation != self.generation:  # a graph kept from an earlier step (retain_graph)
            return
        for index in range(saved.index - 1, -1, -1):
            previous = self._saved[index]()
            if previous is not None:
                previous.prefetch()
                return

    def end_step(self) -> None:
        """After backward: the next forward's saved inputs are numbered from 0 again."""
        self._saved = []
        self.generation += 1

    def __repr__(self) -> str:
        return (
            f"ActivationOffload(device={self.device}, held={self.held_bytes}, peak_held={self.peak_held_bytes}, "
            f"pinned_reserved={self.arena.reserved_bytes})"
        )


def _weak(saved: SavedInput) -> Any:
    return weakref.ref(saved)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.unpack()
