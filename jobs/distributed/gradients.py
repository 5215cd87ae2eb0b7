"""Averaging the trainable gradients across ranks during backward, in buckets, as DDP's reducer does.

Gradients of the weights the optimizer steps on the device (LoRA adapters, a resident model) are gathered
into flat buckets of about ``bucket_bytes`` in the reverse order of ``model.parameters()`` (roughly the
order backward makes them final). A post-accumulate-grad hook copies each final gradient into its bucket;
a full bucket is all-reduced asynchronously while backward continues, always in bucket order so every rank
issues the same collectives in the same order (NCCL needs that). A callback queued on the autograd engine
runs at the end of backward: it launches what is left, waits for every reduction and copies the averages
back into ``param.grad``, so ``backward()`` returns with the gradients averaged, before clipping and the
optimizer. The buckets' layout and the order of their reductions are fixed, so a run is bitwise
reproducible for a given world size.

With gradient accumulation the buckets are reduced after the last micro-batch's backward only (DDP's
``no_sync``): the reducer counts backward passes. Gradients the offload engine sends to the host (optimizer
offload) are reduced one tensor at a time instead, on the device, right before the engine copies them
(``OffloadTrainingManager.register_gradient_hook``), in every micro-batch: they leave the device as each
backward makes them final, and the CPU optimizer starts on them at once. When the ranks split the CPU optimizer
(``optimizer_shard``, optimizer_shards.py) such a gradient is reduce-scattered instead (on gloo: one reduce per
part, onto its rank): each rank receives the average of its part only, written at its place in ``param.grad``,
and the engine copies that part to the host.

Each gradient is divided by the world size before a summing all-reduce or reduce-scatter (gloo has no average).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from offload import OffloadTrainingManager

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
# torch 2.13 renames reduce_scatter_tensor to reduce_scatter_single (the old name warns); torch 2.11 has only the
# old one.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together in one flat tensor."""

    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    ready: set[int] = field(default_factory=set)  # indices of params whose gradient is in ``flat``
    work: dist.Work | None = None
    launched: bool = False


class GradientReducer:
    """Averages ``model``'s trainable gradients over the process group during every backward.

    Example:
        >>> reducer = GradientReducer(model, manager=None, world_size=2, accumulation_steps=1)
        >>> loss.backward()  # returns with every trainable gradient averaged over the ranks
    """

    def __init__(
        self,
        model: nn.Module,
        manager: OffloadTrainingManager | None,
        *,
        world_size: int,
        accumulation_steps: int,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.world_size, self.accumulation_steps = world_size, accumulation_steps
        hosted = {id(p) for p in manager.host_gradient_params()} if manager is not None else set()
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.buckets = _make_buckets([p for p in reversed(trainable) if id(p) not in hosted], bucket_bytes)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._gradient_final) for b in self.buckets for p in b.params
        ]
        split = manager is not None and manager.optimizer_shard is not None  # the ranks split the CPU optimizer
        self._gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._parts = {id(h.param): h.part for h in manager.hosted_parts()} if manager is not None and split else {}
        if manager is not None and hosted:
            reduce = self._reduce_scatter_now if split else self._reduce_now
            self._handles.append(manager.register_gradient_hook(reduce))
        self._backward_passes = 0
        self._finish_queued = False
        self._next_launch = 0

    def remove(self) -> None:
        """Remove every hook: gradients stay local again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- hooks ---------------------------------------------------------------------------------------------
    def _gradient_final(self, param: torch.Tensor) -> None:
        self._queue_finish()
        if not self._last_micro_batch():
            return  # accumulating: reduced once, after the step's last backward
        bucket, index = self._where[id(param)]
        assert param.grad is not None  # a post-accumulate-grad hook runs after the gradient is written
        offset = bucket.offsets[index]
        bucket.flat[offset : offset + param.numel()].copy_(param.grad.reshape(-1))
        bucket.ready.add(index)
        self._launch_ready()

    def _reduce_now(self, param: torch.Tensor) -> None:
        """An engine-hosted gradient, reduced in place before its copy to the host. On CUDA this only makes the
        current stream wait for the reduction (the engine's copy follows it there); gloo waits on the host."""
        assert param.grad is not None
        param.grad.div_(self.world_size)
        dist.all_reduce(param.grad)

    def _reduce_scatter_now(self, param: torch.Tensor) -> None:
        """An engine-hosted gradient of a split CPU optimizer: this rank's part of the average, written at its
        place in ``param.grad`` (the rest of it is left as it was, and never read). Every part spans ``chunk``
        elements of a flat gradient padded to ``world_size * chunk``. A sync point as `_reduce_now` is.

        On gloo, whose reduce-scatter is an all-reduce of a copy of the input (slower than the all-reduce itself,
        docs/offload.md), each part is reduced onto its rank instead, in place: one reduce per rank. NCCL
        reduce-scatters."""
        assert param.grad is not None
        part = self._parts[id(param)]
        flat = param.grad.view(-1)  # autograd's gradient of a contiguous weight is contiguous
        padding = part.chunk * self.world_size - flat.numel()
        sent = torch.nn.functional.pad(flat, (0, padding)) if padding else flat
        sent.div_(self.world_size)
        if self._gloo:
            chunks = sent.split(part.chunk)
            works = [dist.reduce(chunk, dst=rank, async_op=True) for rank, chunk in enumerate(chunks)]
            for work in works:
                work.wait()
            mine = chunks[self._rank]
        else:
            mine = flat.new_empty(part.chunk)
            reduce_scatter(mine, sent)
        if padding or not self._gloo:  # else the part's average is in place already
            flat[part.start : part.stop].copy_(mine[: part.numel])

    def _queue_finish(self) -> None:
        if not self._finish_queued:
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)  # at the end of this backward

    def _finish(self) -> None:
        """The end of a backward: on the step's last micro-batch, reduce what is left and write the averages
        back. This waits for the reductions (on CUDA the current stream waits; gloo waits on the host)."""
        self._finish_queued = False
        last = self._last_micro_batch()
        self._backward_passes += 1
        if not last:
            return
        for bucket in self.buckets:
            bucket.ready = set(range(len(bucket.params)))  # a gradient this rank did not make counts as zero
        self._launch_ready()
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait()
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                averaged = bucket.flat[offset : offset + param.numel()].view_as(param)
                if param.grad is None:
                    param.grad = averaged.clone()
                else:
                    param.grad.copy_(averaged)
            bucket.ready.clear()
            bucket.flat.zero_()  # the next step's unused gradients count as zero
            bucket.work, bucket.launched = None, False
        self._next_launch = 0

    # -- buckets -------------------------------------------------------------------------------------------
    def _last_micro_batch(self) -> bool:
        return self._backward_passes % self.accumulation_steps == self.accumulation_steps - 1

    def _launch_ready(self) -> None:
        """All-reduce every full bucket whose predecessors are launched: the same order on every rank."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.flat.div_(self.world_size)
            bucket.work = dist.all_reduce(bucket.flat, async_op=True)
            bucket.launched = True
            self._next_launch += 1


def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Consecutive runs of ``params`` of one dtype and device, each at most ``bucket_bytes`` (or one tensor)."""
    buckets: list[Bucket] = []
    run: list[nn.Parameter] = []
    for param in params:
        nbytes = sum(p.numel() * p.element_size() for p in run)
        if run and (
            param.dtype != run[0].dtype
            or param.device != run[0].device
            or nbytes + param.numel() * param.element_size() > bucket_bytes
        ):
            buckets.append(_bucket(run))
            run = []
        run.append(param)
    if run:
        buckets.append(_bucket(run))
    return buckets


def _bucket(params: list[nn.Parameter]) -> Bucket:
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += param.numel()
    return Bucket(
        params=params, offsets=offsets, flat=torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    )
