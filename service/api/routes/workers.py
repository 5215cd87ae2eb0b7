"""/v1/workers: each slot, its GPU and memory, and the job it runs."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import GpuMonitorDep, SchedulerDep
from service.api.schemas import WorkerPublic, WorkersPublic

router = APIRouter(prefix="/workers", tags=["workers"])


@router.get("")
def list_workers(scheduler: SchedulerDep, gpus: GpuMonitorDep) -> WorkersPublic:
    """Worker slots with their device's memory (from nvidia-smi) and the job on each."""
    by_index = {gpu.index: gpu for gpu in gpus.gpus()}
    running = dict(scheduler.running)  # a snapshot; the scheduler thread changes it
    workers = []
    for slot in scheduler.slots:
        gpu = by_index.get(slot.device) if slot.device is not None else None
        run = running.get(slot.id)
        workers.append(
            WorkerPublic(
                id=slot.id,
                device=slot.device,
                gpu_name=gpu.name if gpu else None,
                memory_total_bytes=gpu.memory_total_bytes if gpu else None,
                memory_used_bytes=gpu.memory_used_bytes if gpu else None,
                job_id=run.job_id if run else None,
                pid=run.handle.pid if run else None,
            )
        )
    return WorkersPublic(data=workers)
