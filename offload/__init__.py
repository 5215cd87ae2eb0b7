"""Ferry's offload engine: train a model whose weights live on the CPU, streaming them to the device.

The names below are imported on first use (PEP 562): ``offload.stats`` and ``offload.options`` are plain
Python, and a process that only reads the engine's statistics or parses a size (the service's API) must
not pay for torch.

Example:
    >>> from offload import OffloadTrainingManager
    >>> manager = OffloadTrainingManager(model, target_device="cuda", enable_optimizer_cpu_offload=True)
    >>> loss.backward(); manager.after_backward(); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offload.activations import ActivationOffload
    from offload.arena import PinnedArenaPool
    from offload.devices import return_cached_host_memory, set_gpu_memory_limit
    from offload.inference_hold import InferenceHold
    from offload.manager import OffloadTrainingManager
    from offload.offloaders import (
        AlwaysOnGPUParamOffloader,
        BufferOffloader,
        StaticParamOffloader,
        TensorOffloader,
    )
    from offload.options import OffloadOptions, parse_bytes
    from offload.plan import MemoryPlan, plan_memory
    from offload.quant.dequantize_on_arrival import DequantizedParamOffloader
    from offload.quant.on_load import QuantizingFill, quantized_placeholders
    from offload.quant.quantized import QuantizedParamOffloader, quantize_frozen_weights
    from offload.shards import HostedPart, OptimizerShard, ParamPart
    from offload.shared_arena import SharedArenaPool
    from offload.stats import OffloadStats
    from offload.trainable import TrainableParamOffloader
    from offload.units import OffloadUnit, discover_units

_HOME = {
    "ActivationOffload": "offload.activations",
    "PinnedArenaPool": "offload.arena",
    "SharedArenaPool": "offload.shared_arena",
    "HostedPart": "offload.shards",
    "OptimizerShard": "offload.shards",
    "ParamPart": "offload.shards",
    "DequantizedParamOffloader": "offload.quant.dequantize_on_arrival",
    "return_cached_host_memory": "offload.devices",
    "set_gpu_memory_limit": "offload.devices",
    "OffloadTrainingManager": "offload.manager",
    "InferenceHold": "offload.inference_hold",
    "AlwaysOnGPUParamOffloader": "offload.offloaders",
    "BufferOffloader": "offload.offloaders",
    "StaticParamOffloader": "offload.offloaders",
    "TensorOffloader": "offload.offloaders",
    "TrainableParamOffloader": "offload.trainable",
    "OffloadOptions": "offload.options",
    "parse_bytes": "offload.options",
    "MemoryPlan": "offload.plan",
    "plan_memory": "offload.plan",
    "QuantizedParamOffloader": "offload.quant.quantized",
    "quantize_frozen_weights": "offload.quant.quantized",
    "QuantizingFill": "offload.quant.on_load",
    "quantized_placeholders": "offload.quant.on_load",
    "OffloadStats": "offload.stats",
    "OffloadUnit": "offload.units",
    "discover_units": "offload.units",
}
__all__ = [
    "ActivationOffload",
    "AlwaysOnGPUParamOffloader",
    "BufferOffloader",
    "DequantizedParamOffloader",
    "HostedPart",
    "InferenceHold",
    "MemoryPlan",
    "OffloadOptions",
    "OffloadStats",
    "OffloadTrainingManager",
    "OffloadUnit",
    "OptimizerShard",
    "ParamPart",
    "PinnedArenaPool",
    "QuantizedParamOffloader",
    "QuantizingFill",
    "SharedArenaPool",
    "StaticParamOffloader",
    "TensorOffloader",
    "TrainableParamOffloader",
    "discover_units",
    "parse_bytes",
    "plan_memory",
    "quantize_frozen_weights",
    "quantized_placeholders",
    "return_cached_host_memory",
    "set_gpu_memory_limit",
]  # the names of _HOME


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
