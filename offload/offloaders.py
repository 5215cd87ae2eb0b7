"""The four offloader kinds: one object per managed tensor, deciding where its data lives.

Every offloader keeps the tensor object itself stable (optimizers and autograd hold references to it) and
swaps its ``.data`` between a host copy and a device copy. Residency is reference-counted:

* ``holds``: forwards currently running that use the tensor (a unit's forward, or a module called twice).
* ``live_tokens``: autograd saved-tensor references (see ``saved_tensors.py``) not yet released; while the
  backward pass still needs the weight these keep an onloaded copy resident.
"""

from __future__ import annotations

import torch

from offload.transfers import CopyEngine, in_backward


class TensorOffloader:
    """Residency bookkeeping shared by every kind; subclasses say how to onload and offload."""

    kind = "tensor"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine) -> None:
        self.name = name
        self.tensor = tensor
        self.copies = copies
        self.nbytes = tensor.numel() * tensor.element_size()
        self.holds = 0
        self.live_tokens = 0
        self.device_copy: torch.Tensor | None = None

    @property
    def resident(self) -> bool:
        return self.device_copy is not None

    def acquire(self) -> None:
        """A forward that uses the tensor starts: make it resident."""
        self.holds += 1
        if self.device_copy is None:
            self.onload()

    def release(self) -> None:
        """A forward that used the tensor ended. During backward (a recompute under gradient checkpointing)
        the weight stays while saved references still need it, so it is not copied a third time."""
        self.holds -= 1
        if self.holds == 0 and not (in_backward() and self.live_tokens > 0):
            self.offload()

    def token_packed(self) -> None:
        self.live_tokens += 1

    def token_released(self) -> None:
        self.live_tokens -= 1
        if self.live_tokens == 0 and self.holds == 0:
            self.offload()

    def ensure_resident(self) -> torch.Tensor:
        """The device copy, onloading it first if needed (the backward pass asks through this)."""
        if self.device_copy is None:
            self.onload()
        return self.device_copy

    def onload(self) -> None:
        raise NotImplementedError

    def offload(self) -> None:
        raise NotImplementedError

    def detach(self) -> None:
        """Leave the tensor as an ordinary CPU tensor holding its current value."""
        raise NotImplementedError

    def __repr__(self) -> str:
        where = self.device_copy.device if self.device_copy is not None else "cpu"
        return f"{type(self).__name__}({self.name!r}, {self.nbytes} bytes, on {where})"


class StaticParamOffloader(TensorOffloader):
    """A frozen parameter: one permanent host copy; onload copies it in, offload just drops the device copy
    (the host copy is never stale, so nothing goes back over the link)."""

    kind = "static"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine, host: torch.Tensor) -> None:
        super().__init__(name, tensor, copies)
        host.copy_(tensor.data)
        self.host = host
        tensor.data = host

    def onload(self) -> None:
        self.device_copy = self.copies.to_device(self.host)
        self.tensor.data = self.device_copy

    def offload(self) -> None:
        if self.device_copy is None:
            return
        self.tensor.data = self.host
        self.copies.release_device(self.device_copy)
        self.device_copy = None

    def detach(self) -> None:
        self.offload()
        self.tensor.data = self.host.clone()


class BufferOffloader(StaticParamOffloader):
    """A module buffer (BatchNorm running statistics). Like a frozen weight, but a forward may update it in
    place on the device; the version counter tells us, and then the new value is copied back to the host
    copy before the device copy is dropped (the reference rebinds to the stale host copy and loses it)."""

    kind = "buffer"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine, host: torch.Tensor) -> None:
        super().__init__(name, tensor, copies, host)
        # Normalization kernels update running statistics without bumping the version counter; for those
        # buffers the owner's training flag says whether a forward may have changed them.
        self.updated_by: torch.nn.Module | None = None

    def onload(self) -> None:
        super().onload()
        self._version_at_onload = self.tensor._version

    def offload(self) -> None:
        if self.device_copy is None:
            return
        changed = self.tensor._version != self._version_at_onload
        if changed or (self.updated_by is not None and self.updated_by.training):
            self.copies.to_host(self.device_copy, self.host)
        super().offload()


class TrainableParamOffloader(StaticParamOffloader):
    """A trainable parameter whose optimizer runs on the CPU. The host copy is the master: the optimizer
    updates it in place, so weights never travel device -> host. Gradients do: each one is copied to a host
    gradient buffer as soon as autograd finishes accumulating it, and ``hand_over_grad`` gives that buffer to
    ``param.grad`` for the optimizer. Gradient accumulation adds into the buffer."""

    kind = "trainable"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine, host: torch.Tensor,
                 grad_host: torch.Tensor) -> None:
        existing_grad = tensor.grad
        super().__init__(name, tensor, copies, host)
        self.grad_host = grad_host
        self._grad_valid = existing_grad is not None
        if existing_grad is not None:
            grad_host.copy_(existing_grad)
            tensor.grad = None
        self._handed_over = False

    def acquire(self) -> None:
        if torch.is_grad_enabled():
            self._adopt_user_grad()
        super().acquire()

    def _adopt_user_grad(self) -> None:
        """Before a forward that will produce gradients, take ``param.grad`` back from the user so autograd
        accumulates a fresh device gradient: a kept gradient is accumulated into, a cleared one is not."""
        grad = self.tensor.grad
        if grad is not None:
            if grad is not self.grad_host:
                self.grad_host.copy_(grad)
            self._grad_valid = True
            self.tensor.grad = None
        elif self._handed_over:
            self._grad_valid = False
        self._handed_over = False

    def offload_grad(self) -> None:
        """Post-accumulate-grad hook: the gradient is final for this backward; move it to the host."""
        grad = self.tensor.grad
        if grad is None:
            return
        if self._grad_valid:
            self.grad_host.add_(self.copies.to_host(grad))
        else:
            self.copies.to_host(grad, self.grad_host)
            self._grad_valid = True
        self.tensor.grad = None

    def hand_over_grad(self) -> None:
        """After backward: the accumulated host gradient becomes ``param.grad`` for the optimizer."""
        if self._grad_valid and self.device_copy is None:
            self.tensor.grad = self.grad_host
            self._handed_over = True

    def detach(self) -> None:
        grad = self.grad_host.clone() if self._grad_valid else None
        super().detach()
        self.tensor.grad = grad


class AlwaysOnGPUParamOffloader(TensorOffloader):
    """A trainable parameter whose optimizer runs on the device (LoRA adapters): moved once, never streamed."""

    kind = "always_on_device"

    def __init__(self, name: str, tensor: torch.Tensor, copies: CopyEngine) -> None:
        super().__init__(name, tensor, copies)
        self.device_copy = copies.to_device(tensor.data)
        tensor.data = self.device_copy
        if tensor.grad is not None:
            tensor.grad = tensor.grad.to(copies.device)

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def token_packed(self) -> None:
        pass

    def token_released(self) -> None:
        pass

    def onload(self) -> None:
        pass

    def offload(self) -> None:
        pass

    def detach(self) -> None:
        self.tensor.data = self.tensor.data.to("cpu")
        if self.tensor.grad is not None:
            self.tensor.grad = self.tensor.grad.to("cpu")
        self.copies.release_device(self.device_copy)
        self.device_copy = None
