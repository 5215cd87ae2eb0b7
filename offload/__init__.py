"""Ferry's offload engine: train a model whose weights live on the CPU, streaming them to the device.

Example:
    >>> from offload import OffloadTrainingManager
    >>> manager = OffloadTrainingManager(model, target_device="cuda", enable_optimizer_cpu_offload=True)
    >>> loss.backward(); manager.after_backward(); optimizer.step(); optimizer.zero_grad()
"""

from offload.arena import PinnedArenaPool
from offload.devices import set_gpu_memory_limit
from offload.manager import OffloadTrainingManager
from offload.offloaders import (
    AlwaysOnGPUParamOffloader,
    BufferOffloader,
    StaticParamOffloader,
    TensorOffloader,
    TrainableParamOffloader,
)
from offload.options import OffloadOptions, parse_bytes
from offload.plan import MemoryPlan, plan_memory
from offload.quantized import QuantizedParamOffloader, quantize_frozen_weights
from offload.stats import OffloadStats
from offload.units import OffloadUnit, discover_units

__all__ = [
    "AlwaysOnGPUParamOffloader",
    "BufferOffloader",
    "MemoryPlan",
    "OffloadOptions",
    "OffloadStats",
    "OffloadTrainingManager",
    "OffloadUnit",
    "PinnedArenaPool",
    "QuantizedParamOffloader",
    "StaticParamOffloader",
    "TensorOffloader",
    "TrainableParamOffloader",
    "discover_units",
    "parse_bytes",
    "plan_memory",
    "quantize_frozen_weights",
    "set_gpu_memory_limit",
]
