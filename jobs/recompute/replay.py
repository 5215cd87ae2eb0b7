"""A forward's random-number and autocast state, captured once and replayed where backward runs it again.

A recompute must draw the random numbers the forward drew (dropout masks) and compute in the dtypes it computed
in, or its gradients belong to another forward. The reentrant checkpoint (checkpoint.py) and the tiled MLP's
skipped recompute (tiled_mlp.py) both capture this before their forward and replay it around the recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states


@dataclass(frozen=True)
class ForwardState:
    """The generators and autocast settings a forward over some tensors runs under.

    Args:
        device_type: The tensors' accelerator kind (``cuda``), or ``cpu`` when all are on the host.
        cpu_rng: The CPU generator's state.
        devices: The accelerators the tensors are on; ``device_rng`` their generators' states.
        autocast: Per device kind: (enabled, dtype, cache enabled).
    """

    device_type: str
    cpu_rng: torch.Tensor
    devices: list[int]
    device_rng: list[torch.Tensor]
    autocast: dict[str, tuple[bool, torch.dtype, bool]]

    @classmethod
    def capture(cls, *args: Any) -> ForwardState:
        """The state now, for a forward over ``args`` (the tensors among them name the devices)."""
        device_type = next(
            (arg.device.type for arg in args if isinstance(arg, torch.Tensor) and arg.device.type != "cpu"), "cpu"
        )
        devices, device_rng = get_device_states(*args)
        autocast = {
            kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in {"cpu", device_type}
            if torch.amp.is_autocast_available(kind)
        }
        return cls(device_type, torch.get_rng_state(), devices, device_rng, autocast)

    def drew_random_numbers(self) -> bool:
        """Whether a generator advanced since the capture: the forward in between drew random numbers."""
        if not torch.equal(torch.get_rng_state(), self.cpu_rng):
            return True
        if not self.devices:
            return False
        module = torch.get_device_module(self.device_type)
        now = []
        for device in self.devices:
            with module.device(device):
                now.append(module.get_rng_state())
        return any(not torch.equal(a, b) for a, b in zip(now, self.device_rng, strict=True))

    @contextlib.contextmanager
    def replay(self, *, random_numbers: bool = True) -> Iterator[None]:
        """Inside, the generators are as captured (restored to their own state on exit) and autocast is as it
        was; ``random_numbers=False`` replays the autocast settings only."""
        devices = self.devices if random_numbers else []
        with torch.random.fork_rng(devices=devices, enabled=random_numbers, device_type=self.device_type):
            if random_numbers:
                torch.set_rng_state(self.cpu_rng)
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            with contextlib.ExitStack() as stack:
                for kind, (enabled, dtype, cache) in self.autocast.items():
                    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
                yield
