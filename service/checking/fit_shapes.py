"""What the fit check answers (``POST /jobs/validate``'s ``fit``): below the web layer, which re-exports it."""

from __future__ import annotations

from pydantic import BaseModel


class DeviceFit(BaseModel):
    worker: str
    device: str | None
    memory_total_bytes: int | None
    memory_limit_bytes: int | None = None  # offload.gpu_memory_limit: the job may use no more of the GPU
    fits: bool | None


class FitEstimate(BaseModel):
    peak_device_bytes: int
    pinned_host_bytes: int
    optimizer_host_bytes: int = 0  # each rank's CPU optimizer state (optimizer offload), in ordinary host memory
    ranks: int = 1  # distributed.world_size: the ranks of one machine the host figures cover
    notes: list[str]
    host_available_bytes: int
    host_total_bytes: int = 0
    fits: bool | None  # None when the service cannot tell (GPU sizes unknown)
    devices: list[DeviceFit]
    # offload.host_memory_limit (the spec's, or this server's share of host_memory_budget): the engine's pinned
    # host memory against it, and the frozen weights the disk tier reads from the checkpoint's files instead.
    host_memory_limit_bytes: int | None = None
    engine_host_bytes: int = 0
    disk_bytes: int = 0
    disk_read_bytes_per_step: int = 0
    host_limit_fits: bool = True
    # A full fine-tune's pinned masters and gradients (no disk tier moves them) and its optimizer state in swap files.
    trainable_host_bytes: int = 0
    optimizer_swap_bytes: int = 0
