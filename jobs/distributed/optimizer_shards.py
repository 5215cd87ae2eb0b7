"""The ranks split the CPU optimizer under optimizer offload (ZeRO-1): each steps 1/N of every trainable weight.

The engine holds a rank's part (``optimizer_shard``, offload/shards.py): its gradient buffers and optimizer state
have the part's size and its CPU optimizer steps that part of the host master. What crosses the ranks:

- gradients: reduce-scattered on the device (on gloo, reduced part by part onto each part's rank), each rank
  keeping the average of its part, before the engine copies that part to the host (gradients.py);
- weights: in every ``optimizer.step()``, once this rank's updates are done, every rank's updated parts reach
  every rank's host masters (`OptimizerShards.gather_weights`, an engine step hook): an all-gather, done as one
  broadcast per part from the rank that owns it, in the engine's parameter order on every rank. The next
  forward streams whole weights, as on one rank;
- the optimizer's state in checkpoints: `OptimizerShards.whole_state_dict` gathers the parts to rank 0, which
  writes the state as one rank holds it, and `OptimizerShards.own_state_dict` cuts such a state down to this
  rank's parts before ``load_state_dict``: a checkpoint resumes on any world size.

Masters and optimizer state are host tensors, so these collectives run over gloo: the job's own group on the
CPU, a gloo group beside NCCL's on CUDA. Gloo's all-gather (``all_gather_into_tensor``, in place or not, and the
list form) receives into a buffer of the whole output's size and copies out of it; a broadcast receives in
place, so each part goes straight into the masters and nothing the size of a weight is allocated (figures in
docs/offload.md). Which jobs split the optimizer: `splits_optimizer`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from jobs.spec.job import JobSpec
from offload import HostedPart, OffloadTrainingManager, ParamPart


def whole_optimizer_reason(spec: JobSpec) -> str | None:
    """Why each rank of ``spec`` keeps the whole CPU optimizer state although it runs on several ranks with
    optimizer offload (a warning at job start), or None when the ranks split it or nothing is to split."""
    if spec.distributed.world_size == 1 or not spec.offload.enable_optimizer_cpu_offload:
        return None
    if spec.training.max_grad_norm is not None:
        return "training.max_grad_norm clips by the norm of the whole gradient, which each rank then needs"
    if spec.offload.delayed_update:
        return "offload.delayed_update keeps a second host copy of each weight, which is not split"
    return None


def splits_optimizer(spec: JobSpec) -> bool:
    """Whether ``spec``'s ranks each hold and step 1/world_size of the CPU optimizer (optimizer offload on
    several ranks, without clipping or the delayed update; see `whole_optimizer_reason`)."""
    return (
        spec.distributed.world_size > 1
        and spec.offload.enable_optimizer_cpu_offload
        and whole_optimizer_reason(spec) is None
    )


class OptimizerShards:
    """This rank's side of a CPU optimizer split across the ranks. Every rank makes it at the same point, after
    the engine (with ``optimizer_shard``) and the optimizer, before the optimizer's state is loaded.

    Example:
        >>> shards = OptimizerShards(manager, optimizer)
        >>> loss.backward(); manager.after_backward(); optimizer.step()  # every master whole again
    """

    def __init__(self, manager: OffloadTrainingManager, optimizer: torch.optim.Optimizer) -> None:
        shard = manager.optimizer_shard
        if shard is None:
            raise ValueError("OptimizerShards needs an engine made with optimizer_shard")
        self.manager, self.optimizer, self.shard = manager, optimizer, shard
        # A collective (every rank makes it here): gloo for host tensors, the job's own group when it is gloo.
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.parts = manager.hosted_parts()
        self._part_of = {id(h.param): h for h in self.parts}
        self._handle: RemovableHandle = manager.register_step_hook(self.gather_weights)

    def remove(self) -> None:
        """Stop gathering after each step."""
        self._handle.remove()

    def gather_weights(self) -> None:
        """Every rank's updated parts into this rank's host masters: called in ``optimizer.step()`` once this
        rank's updates are in its masters. Each part is broadcast from its rank, every weight's in turn, all
        queued at once and then waited for: a sync point with every rank, before the next forward."""
        works = []
        for hosted in self.parts:
            for rank in range(self.shard.world_size):
                part = self.shard.part(hosted.param.numel(), rank)
                if part.numel:  # the same on every rank: the parts follow from the weight's size alone
                    work = dist.broadcast(part.of(hosted.master), src=rank, group=self.group, async_op=True)
                    works.append(work)
        for work in works:
            work.wait()

    def whole_state_dict(self) -> dict[str, Any] | None:
        """The optimizer's state dict as one rank holds it, on rank 0 (None on the others): each state tensor of
        a part gathered from every rank into its weight's shape. Every rank calls it at the same point (one
        gather per state tensor); rank 0 then holds the whole state until it is written."""
        self.manager.wait_for_optimizer()
        packed = self.optimizer.state_dict()  # its entries are the live state's dicts: copied below, not changed
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for index, entry in sorted(packed["state"].items()):
            hosted = self._part_of.get(id(params[index]))
            state[index] = {
                key: self._gather(value, hosted) if hosted is not None and _per_element(value) else value
                for key, value in sorted(entry.items())
            }
        return {**packed, "state": state} if self.shard.rank == 0 else None

    def own_state_dict(self, whole: dict[str, Any]) -> dict[str, Any]:
        """``whole``, an optimizer state dict as one rank holds it (a checkpoint's, from any world size), with each
        state tensor of a hosted weight cut down to this rank's part: what its ``load_state_dict`` takes."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {}
        for index, entry in whole["state"].items():
            param = params[index]
            hosted = self._part_of.get(id(param))
            state[index] = {
                key: _cut(value, hosted.part) if hosted is not None and _whole_weight(value, param) else value
                for key, value in entry.items()
            }
        return {**whole, "state": state}

    def _gather(self, value: torch.Tensor, hosted: HostedPart) -> torch.Tensor:
        part, numel = hosted.part, hosted.param.numel()
        padded = F.pad(value, (0, part.chunk - part.numel)) if part.numel < part.chunk else value
        received = [torch.empty_like(padded) for _ in range(self.shard.world_size)] if self.shard.rank == 0 else None
        dist.gather(padded, received, dst=0, group=self.group)
        if received is None:
            return value
        return torch.cat(received)[:numel].view(hosted.param.shape)


def _per_element(value: Any) -> bool:
    """A state tensor with one value per element of its weight's part (a moment), not a scalar (``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _whole_weight(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == param.numel()


def _cut(value: torch.Tensor, part: ParamPart) -> torch.Tensor:
    """``part`` of a whole-weight state tensor, in memory of its own (the loaded whole may be a file mapping)."""
    return value.reshape(-1)[part.start : part.stop].clone()
