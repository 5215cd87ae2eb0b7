"""A rank's place in a data-parallel job, and the few collectives the training loop needs.

A rank is one process launched by ``launch.py``. It joins the process group (NCCL on CUDA, one rank per GPU;
gloo on the CPU) before anything else, then runs the ordinary ``run_job``, which asks `current_group` where
it differs: rank 0 alone writes checkpoints and events, every rank reads its rows of each batch
(``batches.py``) and averages its gradients with the others (``gradients.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from jobs.data import BatchSource
    from jobs.distributed.gradients import GradientReducer
    from jobs.events import StepEvent
    from jobs.spec.job import JobSpec
    from offload import OffloadTrainingManager
    from offload.manager import ArenaFactory
    from offload.shared_arena import SharedArenaPool

log = logging.getLogger(__name__)

# The variables torch's launcher sets that would make accelerate set up data parallelism (and wrap the
# model in DDP) on its own; read into the group, then removed, so accelerate sees one process.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
StopRequest = Literal["pause", "cancel"] | None
STOP_CODES: dict[StopRequest, int] = {None: 0, "pause": 1, "cancel": 2}


@dataclass(kw_only=True)
class RankGroup:
    """This process's rank in the job's process group.

    Attributes:
        rank: 0 .. world_size - 1; rank 0 leads (writes checkpoints, reports events, polls for a stop).
        local_rank: the rank on this machine: its GPU index on CUDA.
        world_size: ranks in the job.
        device: where the rank computes, and where its collectives' tensors live (NCCL needs CUDA tensors).
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    run_id: str = "local"  # the launcher's run id: names the shared arena's files
    reducer: GradientReducer | None = field(default=None, repr=False)
    shared_arena: SharedArenaPool | None = field(default=None, repr=False)

    @property
    def leads(self) -> bool:
        """Rank 0: the one rank that writes checkpoints, samples and events."""
        return self.rank == 0

    def union_spec(self, spec: JobSpec) -> JobSpec:
        """``spec`` with the global batch (``world_size * batch_size``): what each rank builds its data from."""
        training = spec.training.model_copy(update={"batch_size": spec.training.batch_size * self.world_size})
        return spec.model_copy(update={"training": training})

    def shard(self, source: BatchSource) -> BatchSource:
        """This rank's rows of every batch of ``source`` (built from `union_spec`)."""
        from jobs.distributed.batches import RankShard

        return RankShard(source, rank=self.rank, world_size=self.world_size)

    def reduce_gradients(
        self, model: nn.Module, manager: OffloadTrainingManager | None, *, accumulation_steps: int
    ) -> None:
        """Average ``model``'s trainable gradients across the ranks from now on, during each backward."""
        from jobs.distributed.gradients import GradientReducer

        self.reducer = GradientReducer(
            model, manager, world_size=self.world_size, accumulation_steps=accumulation_steps
        )

    def frozen_arena_before_attach(self) -> ArenaFactory:
        """Call right before attaching the offload engine, and `after_attach` right after: the factory of the
        arena the frozen weights' host copies go in, shared by this machine's ranks (offload/shared_arena.py).
        Local rank 0 makes and fills its chunks; the other ranks wait here until it has, then map them."""
        from offload.shared_arena import SharedArenaPool

        def make(expected_bytes: int, pin: bool) -> SharedArenaPool:
            self.shared_arena = SharedArenaPool(
                expected_bytes, name=f"ferry-{self.run_id}-frozen", leader=self.local_rank == 0, pin=pin
            )
            return self.shared_arena

        if self.local_rank != 0:
            dist.barrier()  # paired with the leader's in after_attach: its chunks are filled
        return make

    def after_attach(self) -> None:
        """See `frozen_arena_before_attach`. Once every rank has mapped the chunks their files are removed:
        the memory lives while a rank maps it, and nothing stays in /dev/shm after the job, however it ends."""
        if self.local_rank == 0:
            dist.barrier()  # the chunks are filled: the other ranks may map them
        dist.barrier()  # every rank has mapped them
        if self.shared_arena is not None:
            self.shared_arena.unlink()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` (a step's loss) over the ranks; every rank calls it at the same point."""
        total = value.detach().to(self.device, torch.float32).clone()
        dist.all_reduce(total)  # SUM: gloo has no AVG
        return total / self.world_size

    def stop_request(self, poll: Callable[[], StopRequest] | None) -> StopRequest:
        """Rank 0's answer to ``poll`` (pause, cancel or None), the same on every rank: each calls this before
        the same step, so all stop there together. This is a sync point (one tiny broadcast a step)."""
        code = torch.tensor([STOP_CODES[poll()] if self.leads and poll is not None else 0], device=self.device)
        dist.broadcast(code, src=0)
        return {value: key for key, value in STOP_CODES.items()}[int(code.item())]

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (early stopping: the ranks must leave the loop at the same step)."""
        value = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(value, src=0)
        return bool(value.item())

    def with_rank_figures(self, event: StepEvent, step_s: float) -> StepEvent:
        """``event`` with every rank's step time and memory (``ranks``), gathered to all ranks."""
        from jobs.events import RankFigures

        optimizer = event.offload.optimizer_host_bytes if event.offload is not None else 0
        mine = torch.tensor(
            [step_s, event.device_peak_bytes, event.device_allocated_bytes, event.host_rss_bytes, optimizer],
            dtype=torch.float64,  # exact for byte counts below 2**53
            device=self.device,
        )
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        figures = [
            RankFigures(
                rank=rank,
                step_s=float(row[0]),
                device_peak_bytes=int(row[1]),
                device_allocated_bytes=int(row[2]),
                host_rss_bytes=int(row[3]),
                optimizer_host_bytes=int(row[4]),
            )
            for rank, row in enumerate(torch.stack(every).tolist())
        ]
        return event.model_copy(update={"ranks": figures})


_current: RankGroup | None = None


def current_group() -> RankGroup | None:
    """This process's rank group, or None outside a data-parallel job (``world_size: 1`` runs here too)."""
    return _current


def leads() -> bool:
    """True on rank 0 and outside a data-parallel job: this process writes checkpoints and events."""
    return _current is None or _current.leads


def join_group(device_choice: str) -> RankGroup:
    """Join the process group torch's launcher described in the environment; ``device_choice`` is the spec's
    ``device``. On CUDA each rank takes the GPU of its local rank and NCCL; on the CPU, gloo."""
    global _current
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if device_choice != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # before any CUDA work: "cuda" now means this rank's GPU
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        # The ranks of a CPU job share the cores its slot was given (OMP_NUM_THREADS, read by each rank).
        torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=device if backend == "nccl" else None)
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", f"pid{os.getppid()}")
    _current = RankGroup(rank=rank, local_rank=local_rank, world_size=world_size, device=device, run_id=run_id)
    log.info("rank %d of %d (local %d) on %s over %s", rank, world_size, local_rank, device, backend)
    return _current


def leave_group() -> None:
    """Remove the gradient hooks and destroy the process group."""
    global _current
    if _current is not None and _current.reducer is not None:
        _current.reducer.remove()
    if _current is not None and _current.shared_arena is not None:
        _current.shared_arena.unlink()  # left only if the job failed between making and mapping the chunks
    _current = None
    if dist.is_initialized():
        dist.destroy_process_group()
