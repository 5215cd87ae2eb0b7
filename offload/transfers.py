"""Copies between host and device, counted. The one place bytes cross the link."""

from __future__ import annotations

import torch

from offload.stats import StatsCounter


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. a checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class CopyEngine:
    """Makes device copies of host tensors and copies device tensors back, updating the counters.

    With ``target_device="cpu"`` the "device" copy is still a separate tensor, so the whole onload/offload
    logic runs for real in tests without an accelerator.
    """

    def __init__(self, device: torch.device, stats: StatsCounter) -> None:
        self.device = device
        self.stats = stats

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host``. Asynchronous from pinned memory: it is queued on the current stream,
        which the compute that uses it runs on, so no synchronization is needed."""
        device_copy = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        device_copy.copy_(host, non_blocking=True)
        nbytes = host.numel() * host.element_size()
        self.stats.record_h2d(nbytes)
        self.stats.hold(nbytes)
        return device_copy

    def release_device(self, device_copy: torch.Tensor) -> None:
        self.stats.drop(device_copy.numel() * device_copy.element_size())

    def to_host(self, device_tensor: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``device_tensor`` into ``host`` (or a new host tensor). Blocking: the caller reads it next."""
        if host is None:
            host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype)
        host.copy_(device_tensor)
        self.stats.record_d2h(device_tensor.numel() * device_tensor.element_size())
        return host
