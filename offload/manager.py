"""OffloadTrainingManager: attach offloading to a CPU-resident model and train it on a device."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from offload import auto_budget
from offload.activations import ActivationOffload
from offload.arena import PinnedArenaPool, aligned
from offload.devices import can_pin_memory, resolve_target_device, set_gpu_memory_limit, synchronize
from offload.disk import DiskLocator, DiskStage
from offload.flat import FlatGroup
from offload.inference_hold import InferenceHold, hold_units, release_units
from offload.layout import shaped_like
from offload.offloaders import (
    AlwaysOnGPUParamOffloader,
    BufferOffloader,
    StaticParamOffloader,
    TensorOffloader,
)
from offload.optimizer_step import StepDuringBackward
from offload.optimizer_swap import OptimizerSwap
from offload.options import OffloadOptions, format_bytes, parse_bytes
from offload.plan import UnitLayout, plan_memory
from offload.quant.dequantize_on_arrival import ArrivalBatch, DequantizedParamOffloader, dequantizes_on_arrival
from offload.quant.dequantize_on_arrival import room_bytes as arrival_room_bytes
from offload.quant.payload import is_quantized, link_bytes, stored_bytes
from offload.quant.quantized import QuantizedParamOffloader
from offload.ring import DeviceRing, Placement
from offload.saved_tensors import SavedTensorRouter
from offload.schedule import PrefetchSchedule
from offload.shards import HostedPart, OptimizerShard
from offload.stats import OffloadStats, StatsCounter
from offload.trainable import TrainableParamOffloader
from offload.transfers import CopyEngine, in_backward
from offload.units import OffloadUnit, UnitPlan

ArenaFactory = Callable[[int, bool], PinnedArenaPool]  # (expected bytes, pin) -> the frozen weights' arena
Initializer = Callable[[str, torch.Tensor, torch.Tensor], None]  # (name, meta tensor, pinned host copy to fill)

log = logging.getLogger(__name__)


class OffloadTrainingManager:
    """Train ``model`` on ``target_device`` while its weights live in (pinned) CPU memory.

    Before a unit's forward its weights are copied to the device and dropped after it; the backward pass
    copies them again when it needs them. Frozen weights and buffers are copied from a pinned arena; trainable
    weights either move to the device once (``enable_optimizer_cpu_offload=False``, e.g. LoRA adapters) or
    stay on the CPU with their optimizer, their gradients copied to the CPU as backward produces them.

    Args:
        model: a module whose parameters and buffers are all on the CPU.
        target_device: where compute runs: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` (for tests), a ``torch.device``.
        enable_optimizer_cpu_offload: keep trainable weights, gradients and optimizer state on the CPU.
        cpu_offload_split_threshold: in MB; modules at or under it are one unit, larger ones are split.
        options: engine tuning (:class:`OffloadOptions`).
        initialize: for a model built on the meta device (no memory): called as
            ``initialize(name, tensor, host)`` for each meta tensor with its pinned host copy to fill (from a
            checkpoint, or random values); the tensor then *is* that host copy. Nothing is materialized in
            ordinary memory first. Trainable tensors without optimizer offload must be real CPU tensors.
        frozen_arena: makes the arena for the frozen weights' host copies (data-parallel ranks share one).
        optimizer_shard: this process is one of several data-parallel ranks that split the CPU optimizer
            (optimizer offload, shards.py): its gradient buffers and optimizer state hold its part of each
            trainable weight. The caller averages the gradients into that part (``register_gradient_hook``)
            and gathers the other parts after each step (``register_step_hook``).
        disk: where frozen weights lie in their checkpoint files (``(name, tensor) -> FileRange | None``): with
            ``options.host_memory_limit`` the units the limit leaves no room for are read from there on each
            use (the disk tier, disk.py) and never held in host memory; meta tensors on disk need no
            ``initialize``. Between uses such a weight is a view of its file's read-only map.

    Example:
        >>> model = ToyModel()                                  # stays on the CPU
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        >>> manager = OffloadTrainingManager(model, "cuda", enable_optimizer_cpu_offload=True)
        >>> loss = F.mse_loss(model(x), y); loss.backward()
        >>> manager.after_backward(); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        target_device: str | torch.device | int,
        enable_optimizer_cpu_offload: bool = False,
        cpu_offload_split_threshold: float | None = None,
        options: OffloadOptions | None = None,
        *,
        initialize: Initializer | None = None,
        frozen_arena: ArenaFactory | None = None,
        optimizer_shard: OptimizerShard | None = None,
        disk: DiskLocator | None = None,
    ) -> None:
        self.device = resolve_target_device(target_device)
        self.options = options if options is not None else OffloadOptions()
        self.enable_optimizer_cpu_offload = enable_optimizer_cpu_offload
        if optimizer_shard is not None and not enable_optimizer_cpu_offload:
            raise ValueError("optimizer_shard needs enable_optimizer_cpu_offload=True: it splits the CPU optimizer")
        self.optimizer_shard = optimizer_shard
        _check_model(model, allow_meta=initialize is not None)
        self.model = model
        self._initialize = initialize
        # Before the first device allocation, so nothing the engine holds is ever above the limit.
        self._previous_limit = _memory_fraction(self.device)
        if self.options.gpu_memory_limit is not None:
            set_gpu_memory_limit(self.device, parse_bytes(self.options.gpu_memory_limit))
        # Host and device memory are planned before anything is allocated (plan.py); the estimate a job
        # gets at submit reads the same plan.
        self.plan = plan_memory(
            model,
            enable_optimizer_cpu_offload=enable_optimizer_cpu_offload,
            cpu_offload_split_threshold=cpu_offload_split_threshold,
            options=self.options,
            link_bytes=link_bytes,  # a quantized weight takes its stored bytes in the arena and the ring
            # and, dequantized on arrival, room for its dequantized form beside each ring slot
            room_bytes=arrival_room_bytes if self.options.dequantize_on_arrival else None,
            optimizer_shard=optimizer_shard,
            disk=disk,
        )
        self._check_plan_fits()
        self._stats = StatsCounter()
        self._copies = CopyEngine(self.device, self._stats, side_streams=self.options.prefetch > 0)
        # The forward and backward orders are recorded during the first step; prefetching and the budget
        # follow them after.
        self._schedule = PrefetchSchedule(self.options.prefetch)
        # gpu_memory_budget='auto': the bytes measured after step 2 (None before, and on the CPU), from the peak
        # reserved since here (the ring below included).
        self.measured_budget: int | None = None
        if self.options.gpu_memory_budget == auto_budget.AUTO_BUDGET:
            auto_budget.start_measuring(self.device)
        pin = self.options.pin_memory and can_pin_memory()
        frozen = _frozen_host_bytes(model) if frozen_arena is not None else 0
        self.arena = PinnedArenaPool(sum(aligned(n) for n in self.plan.host_sizes) - frozen, pin=pin)
        # The frozen weights' host copies: in the arena, or in one the processes of a machine share
        # (shared_arena.py: data-parallel ranks stream from one host copy).
        self.frozen_arena = frozen_arena(frozen, pin) if frozen_arena is not None else self.arena
        self.ring = DeviceRing(self.plan.ring_classes, self.device, reuse=self.options.reuse_ring_slots)
        # The disk tier (disk.py): units the host limit leaves no room for read from their files on each use.
        disk_files = [r.path for layout in self.plan.layouts for r in layout.disk]
        self.disk_stage = (
            DiskStage(
                disk_files,
                slots=self.plan.staging_slots,
                slot_bytes=self.plan.staging_slot_bytes,
                pin=pin,
                device=self.device,
                disk_io=self.plan.disk_io,
            )
            if disk_files
            else None
        )
        self._on_disk: set[int] = set()  # ids of the tensors on the disk tier
        # What gradient checkpointing keeps, in pinned host memory till the recompute (activations.py); the
        # model's checkpoint function must be wrapped (``activations.wrap``) by whoever knows where it is.
        self.activations = (
            ActivationOffload(
                self._copies, planned_bytes=sum(map(aligned, self.options.activation_host_bytes)), pin=pin
            )
            if self.options.offload_activations
            else None
        )
        self._stats.planned_device_bytes = self.ring.nbytes
        self._offloaders: dict[int, TensorOffloader] = {}
        self._placements: dict[int, tuple[int, Placement]] = {}  # id(unit) -> its ring class and placement
        self.units = [self._make_unit(u, layout) for u, layout in zip(self.plan.units, self.plan.layouts, strict=True)]
        self._mark_statistics_buffers(model)
        # Adapters trained on the device never leave it: autograd saves them as it saves any tensor.
        routed = {key: o for key, o in self._offloaders.items() if o.kind != "always_on_device"}
        self._router = SavedTensorRouter(routed)
        self._handles: list[RemovableHandle] = []
        self._attach(self.plan.units)
        self._stepper: StepDuringBackward | None = None
        # register_gradient_hook's; an OrderedDict, which RemovableHandle can refer to weakly
        self._gradient_hooks: OrderedDict[int, Callable[[torch.Tensor], None]] = OrderedDict()
        self._step_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()  # register_step_hook's
        self._stats.start_step()
        log.info("offloading %s; %s", self, self.plan.describe())

    # ----------------------------------------------------------------- setup
    def _check_plan_fits(self) -> None:
        limit = parse_bytes(self.options.gpu_memory_limit)  # an int already (OffloadOptions.__post_init__)
        if limit is not None and self.plan.ring_bytes > limit:
            raise ValueError(
                f"the device ring for streamed weights needs {self.plan.ring_bytes / 2**30:.2f} GiB "
                f"(prefetch={self.options.prefetch}; largest unit {self.plan.largest_unit_bytes / 2**30:.2f} GiB) "
                f"but gpu_memory_limit is {limit / 2**30:.2f} GiB; lower prefetch, use granularity='leaf' or "
                "cpu_offload_split_threshold for smaller units, or raise the limit"
            )
        plan = self.plan
        if not plan.host_fits:
            assert plan.host_memory_limit is not None  # host_fits is True without one
            raise ValueError(
                f"host_memory_limit is {format_bytes(plan.host_memory_limit)} but the engine's pinned host memory "
                f"needs {format_bytes(plan.host_bytes)} with every frozen weight it can read from disk on the disk "
                f"tier ({format_bytes(plan.disk_bytes)}; arena {format_bytes(plan.pinned_reserved_bytes)}, staging "
                f"ring {format_bytes(plan.staging_bytes)}); raise the limit, lower disk_read_ahead, or load the "
                "weights from checkpoint files the disk tier can read (pass disk=)"
            )

    def _wants_host_copy(self, tensor: torch.Tensor) -> bool:
        trainable = isinstance(tensor, nn.Parameter) and tensor.requires_grad
        # With a budget, some trainable parameters stay on the device with their optimizer (plan.py).
        return not trainable or (self.enable_optimizer_cpu_offload and id(tensor) not in self.plan.device_trainables)

    def _make_unit(self, plan: UnitPlan, layout: UnitLayout) -> OffloadUnit:
        by_id = {id(t): (name, t) for name, t in plan.tensors}
        placement = self.ring.placement(layout.ring_class, layout.slot)
        group = None
        hosts: dict[int, torch.Tensor] = {}
        if layout.span:
            span = [by_id[i][1] for i in layout.span]
            on_disk = None
            if layout.disk:
                assert self.disk_stage is not None  # made for every plan with disk units
                on_disk = (self.disk_stage, list(layout.disk))
                self._on_disk.update(id(t) for t in span)
            group = FlatGroup(span, self.frozen_arena, self._copies, name=plan.name, disk=on_disk)
            group.placement = placement
            hosts = {id(t): group.host_view(i, t) for i, t in enumerate(span)}
        ordered = sorted(plan.tensors, key=lambda nt: -nt[1].numel() * nt[1].element_size())
        offloaders = [self._offloader_for(name, tensor, hosts.get(id(tensor))) for name, tensor in ordered]
        for offloader in offloaders:
            if group is not None and id(offloader.tensor) in hosts and offloader.group is None:
                assert isinstance(offloader, StaticParamOffloader)  # spans hold only what never changes
                group.add(offloader)
            elif id(offloader.tensor) in layout.offsets and offloader.placement is None:
                offloader.placement, offloader.slot_offset = placement, layout.offsets[id(offloader.tensor)]
                if isinstance(offloader, DequantizedParamOffloader):
                    offloader.room_offset = layout.room_offsets[id(offloader.tensor)]
        # The unit's NF4 weights arrive together: one dequantization call per visit, not one per weight.
        arriving = [o for o in offloaders if isinstance(o, DequantizedParamOffloader) and o.batch is None]
        arriving = [o for o in arriving if o.placement is not None and o.placement is placement]
        for dtype in {o.like.dtype for o in arriving}:  # one batch per dtype: its rooms are viewed as one
            ArrivalBatch([o for o in arriving if o.like.dtype == dtype])
        unit = OffloadUnit(plan.name, offloaders)
        if placement is not None and layout.ring_class is not None:
            self._placements[id(unit)] = (layout.ring_class, placement)
        return unit

    def _offloader_for(self, name: str, tensor: torch.Tensor, host: torch.Tensor | None) -> TensorOffloader:
        existing = self._offloaders.get(id(tensor))
        if existing is not None:  # shared (tied) tensor: one offloader, one host copy
            return existing
        if is_quantized(tensor) and not tensor.requires_grad:
            arrival = self.options.dequantize_on_arrival and dequantizes_on_arrival(tensor)
            kind = DequantizedParamOffloader if arrival else QuantizedParamOffloader
            payload = self.frozen_arena.allocate((stored_bytes(tensor),), torch.uint8)
            # A quantized placeholder (quant/on_load.py): its payload is filled here, quantized (unless another
            # process of this machine filled the shared arena's bytes).
            if tensor.is_meta and not self.frozen_arena.filled_elsewhere(payload):
                self._fill_placeholder(name, tensor, payload)
            quantized = kind(name, tensor, self._copies, payload)
            quantized.on_backward_use = self._schedule.weight_unpacked
            self._offloaders[id(tensor)] = quantized
            return quantized
        if host is None and self._wants_host_copy(tensor):
            frozen = isinstance(tensor, nn.Parameter) and not tensor.requires_grad
            host = self._host_like(tensor, self.frozen_arena if frozen else self.arena)
        if id(tensor) in self._on_disk:
            assert host is not None  # its view of its file
            self._adopt_filled(tensor, host)  # the bytes are the file's: nothing to read or copy now
        elif host is not None and self.frozen_arena.filled_elsewhere(host):
            self._adopt_filled(tensor, host)  # another process of this machine wrote these bytes
        if tensor.is_meta:
            self._materialize(name, tensor, host)
        offloader: TensorOffloader
        if not self._wants_host_copy(tensor):  # a trainable weight without optimizer offload stays on the device
            offloader = AlwaysOnGPUParamOffloader(name, tensor, self._copies)
        elif not isinstance(tensor, nn.Parameter):
            assert host is not None  # made above for every tensor that wants a host copy
            offloader = BufferOffloader(name, tensor, self._copies, host)
        else:
            assert host is not None
            if not tensor.requires_grad:
                offloader = StaticParamOffloader(name, tensor, self._copies, host)
                if id(tensor) in self._on_disk:
                    offloader.restore = self._restorer(tensor, host)
            else:
                offloader = self._trainable(name, tensor, host)
        offloader.on_backward_use = self._schedule.weight_unpacked
        self._offloaders[id(tensor)] = offloader
        return offloader

    def _restorer(self, tensor: torch.Tensor, host: torch.Tensor) -> Callable[[], torch.Tensor]:
        """What reads a disk-tier weight into memory of its own when the engine detaches."""
        stage = self.disk_stage
        assert stage is not None
        layout = next(lay for lay in self.plan.layouts if id(tensor) in lay.span and lay.disk)
        piece = layout.disk[layout.span.index(id(tensor))]
        return lambda: stage.read_copy(piece, host)

    def _trainable(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> TrainableParamOffloader:
        """A host master's offloader with its gradient buffer: the whole gradient, or this rank's part of it."""
        if self.optimizer_shard is None:
            return TrainableParamOffloader(name, tensor, self._copies, host, self._host_like(tensor))
        if not host.is_contiguous():  # a part is a range of the flat weight
            raise ValueError(f"optimizer_shard needs contiguous trainable weights; {name!r} is not (.contiguous() it)")
        part = self.optimizer_shard.part(tensor.numel())
        grad_host = self.arena.allocate((part.numel,), tensor.dtype)
        return TrainableParamOffloader(name, tensor, self._copies, host, grad_host, part)

    def _host_like(self, tensor: torch.Tensor, arena: PinnedArenaPool | None = None) -> torch.Tensor:
        """Arena memory for ``tensor`` with its layout (a transposed weight stays transposed)."""
        return shaped_like((arena or self.arena).allocate((tensor.numel(),), tensor.dtype), tensor)

    def _adopt_filled(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """``tensor`` becomes ``host``, whose bytes another process filled: nothing is read or copied."""
        if tensor.is_meta:  # the same tensor object, now over the host copy (see _materialize)
            alias = nn.Parameter(host, requires_grad=False) if isinstance(tensor, nn.Parameter) else host[...]
            torch.utils.swap_tensors(tensor, alias)
        else:
            tensor.data = host

    def _materialize(self, name: str, tensor: torch.Tensor, host: torch.Tensor | None) -> None:
        """A tensor built on the meta device: ``initialize`` fills its pinned host copy, then the tensor object
        itself (which modules, tied weights and optimizers refer to) becomes that host copy."""
        if host is None or self._initialize is None:
            raise ValueError(
                f"{name!r} is on the meta device but is trainable without optimizer offload (it lives on the "
                "device, not in the pinned arena); materialize trainable tensors on the CPU before attaching"
            )
        self._initialize(name, tensor, host)
        alias = (
            nn.Parameter(host, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else host[...]
        )
        torch.utils.swap_tensors(tensor, alias)

    def _fill_placeholder(self, name: str, tensor: torch.Tensor, payload: torch.Tensor) -> None:
        """A quantized placeholder's payload, filled by ``initialize`` (a ``QuantizingFill`` quantizes the weight's
        values into it); the offloader then rebuilds the torchao tensor over the payload."""
        if self._initialize is None:
            raise ValueError(f"{name!r} is a meta quantized placeholder; pass initialize= to fill its payload")
        self._initialize(name, tensor, payload)

    def _mark_statistics_buffers(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._NormBase):
                for buffer in module.buffers(recurse=False):
                    offloader = self._offloaders.get(id(buffer))
                    if isinstance(offloader, BufferOffloader):
                        offloader.updated_by = module

    def _attach(self, plans: list[UnitPlan]) -> None:
        for plan, unit in zip(plans, self.units, strict=True):
            for module in plan.hook_modules:
                self._handles.append(
                    module.register_forward_pre_hook(functools.partial(self._onload_before_forward, unit))
                )
                self._handles.append(
                    module.register_forward_hook(functools.partial(self._offload_after_forward, unit), always_call=True)
                )
        for offloader in self._offloaders.values():
            if isinstance(offloader, TrainableParamOffloader):
                hook = functools.partial(self._offload_grad_after_backward, offloader)
                self._handles.append(offloader.tensor.register_post_accumulate_grad_hook(hook))

    # ----------------------------------------------------------------- hooks
    def _onload_before_forward(self, unit: OffloadUnit, module: nn.Module, args: Any) -> None:
        # A unit the budget keeps on the device (fixed after the first step) has nothing to copy, count or
        # stand tokens in for; it only drives the prefetching of the units after it. Its saved tensors
        # go to autograd (or checkpointing) directly: the per-tensor work is host time on a launch-bound step.
        if not unit.streams and torch.compiler.is_compiling():
            # Traced into a compiled forward-only region (GRPO's compiled decode step, which runs only where no
            # unit streams): nothing to copy nor to prefetch, and the schedule's bookkeeping would break the graph.
            return
        backward = in_backward()
        if unit.streams:
            self._router.enter()
            if not backward:
                self._schedule.forward_started(unit)
            unit.onload()
        if backward:  # a checkpoint recompute
            self._schedule.backward_used(unit, unit.offloaders)
        else:
            self._schedule.forward_onloaded(unit)

    def _offload_after_forward(self, unit: OffloadUnit, module: nn.Module, args: Any, output: Any) -> None:
        if unit.streams:
            unit.offload()
            self._router.exit()

    def _offload_grad_after_backward(self, offloader: TrainableParamOffloader, param: torch.Tensor) -> None:
        for hook in self._gradient_hooks.values():  # e.g. an all-reduce: the copy below is queued after it
            hook(param)
        offloader.offload_grad()
        if self._stepper is not None:
            self._stepper.grad_ready(offloader)

    # ----------------------------------------------------------------- public API
    def attach_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        accumulation_steps: int = 1,
        delayed_update: bool = False,
        warmup_steps: int = 10,
        cpu_threads: int | None = None,
        swap_folder: str | Path | None = None,
        swap_read_ahead: int = 2,
    ) -> None:
        """Step ``optimizer`` per parameter in the background, overlapped with the GPU (optimizer offload).

        Each parameter is updated on a CPU worker thread as soon as its gradient reaches the host, during
        the backward of the last of ``accumulation_steps`` micro-batches (call ``after_backward`` after
        each one). ``optimizer.step()`` returns at once; the next forward waits for each update just before
        it reads that parameter. ``optimizer.zero_grad()`` always sets gradients to None.

        ``delayed_update=True`` (after ``warmup_steps`` exact steps): step t's update runs during step t+1,
        which still reads the weights from before it, so the GPU does not wait for the CPU; gradients are
        one step stale (docs/offload.md). Do not combine with global-norm gradient clipping, which needs
        every gradient before any update. Attach after creating LR schedulers and after
        ``optimizer.load_state_dict`` (both replace what the per-parameter steps refer to).
        ``cpu_threads``: the updates' intra-op threads (default: all but one, left to the training loop).
        With ``optimizer_shard`` each update steps this process's part, and ``optimizer.step()`` waits for every
        update, then runs the step hooks (``register_step_hook``).

        ``swap_folder``: keep the optimizer's state (every non-scalar state tensor, AdamW's two moments) in one
        file per parameter there instead of in memory, read before each update into a ring of
        ``swap_read_ahead + 1`` slots of the largest parameter's state and written back after it, the next
        parameters' reads running ahead on a thread (optimizer_swap.py). Between updates the state is views of
        those files' maps; ``remove()`` deletes the files (``copy=True`` first reads the state back into memory).
        The files are read and written as ``options.disk_io`` says (``O_DIRECT`` where the folder allows it).
        """
        if not self.enable_optimizer_cpu_offload:
            raise ValueError(
                "attach_optimizer needs enable_optimizer_cpu_offload=True: the optimizer must run "
                "on the CPU for its steps to overlap with the GPU's backward"
            )
        if swap_folder is not None and delayed_update:
            raise ValueError(
                "swap_folder cannot be combined with delayed_update: a delayed update runs while the next step "
                "reads the weights, and its state's reads would compete with the forward's; use exact updates"
            )
        if not isinstance(swap_read_ahead, int) or swap_read_ahead < 0:
            raise ValueError(f"swap_read_ahead must be an integer >= 0; got {swap_read_ahead!r}")
        swap = None
        if swap_folder is not None:  # disk_io as the disk tier's: O_DIRECT past the page cache where it can
            swap = OptimizerSwap(Path(swap_folder), slots=swap_read_ahead + 1, disk_io=self.options.disk_io)
        trainable = {k: o for k, o in self._offloaders.items() if isinstance(o, TrainableParamOffloader)}

        def priority(offloader: TrainableParamOffloader) -> int | None:
            unit = self._schedule.unit_of.get(id(offloader))
            return unit.index if unit is not None else None

        self._stepper = StepDuringBackward(
            optimizer,
            trainable,
            accumulation_steps,
            priority=priority,
            delayed_update=delayed_update,
            warmup_steps=warmup_steps,
            cpu_threads=cpu_threads,
            on_device=self.plan.device_trainables,
            after_step=self._run_step_hooks if self.optimizer_shard is not None else None,
            swap=swap,
        )
        for offloader in trainable.values():
            offloader.before_read = self._stepper.before_read
        # Reading the weights or the optimizer state (a checkpoint) first finishes the background updates.
        stepper = self._stepper
        # With the state on disk, its writes finish too: the state dict reads it through the files' maps.
        self._handles.append(self.model.register_state_dict_pre_hook(lambda *args: stepper.wait()))
        self._handles.append(optimizer.register_state_dict_pre_hook(lambda *args: stepper.wait_for_swap()))

    @property
    def optimizer_swap(self) -> OptimizerSwap | None:
        """The optimizer state's swap files (``attach_optimizer(swap_folder=...)``), None where it is in memory."""
        return self._stepper.swap if self._stepper is not None else None

    def host_gradient_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients this engine sends to the host as backward makes them final
        (trainable weights with host masters, under optimizer offload)."""
        return [o.tensor for o in self._offloaders.values() if isinstance(o, TrainableParamOffloader)]

    def register_gradient_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """Run ``hook(param)`` on each of `host_gradient_params` when its device gradient (``param.grad``) is
        final for a backward, before the engine queues its copy to the host on the current stream's work
        (so whatever ``hook`` queues there, e.g. an all-reduce across data-parallel ranks, is in the copy)."""
        handle = RemovableHandle(self._gradient_hooks)
        self._gradient_hooks[handle.id] = hook
        return handle

    def register_step_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """With ``optimizer_shard``: run ``hook()`` in ``optimizer.step()`` (``attach_optimizer``) after every update
        of the step has finished, before the next forward reads a weight: the host masters then hold this
        process's updated parts (`hosted_parts`), and a data-parallel caller gathers the other ranks' there."""
        handle = RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = hook
        return handle

    def _run_step_hooks(self) -> None:
        for hook in list(self._step_hooks.values()):
            hook()

    def hosted_parts(self) -> list[HostedPart]:
        """Each trainable weight whose optimizer runs on the host, in the engine's (deterministic) order: the
        parameter, its host master and the part this process steps (the whole weight without a shard)."""
        shard = self.optimizer_shard or OptimizerShard(rank=0, world_size=1)
        return [
            HostedPart(o.tensor, o.host, o.part or shard.part(o.tensor.numel()))
            for o in self._offloaders.values()
            if isinstance(o, TrainableParamOffloader)
        ]

    def wait_for_optimizer(self) -> None:
        """Finish the background optimizer updates (``attach_optimizer``) before reading the weights directly, and
        with ``swap_folder`` their state's writes; ``state_dict()`` of the model or the optimizer does this itself."""
        if self._stepper is not None:
            self._stepper.wait_for_swap()

    def after_backward(self) -> None:
        """Call between ``backward()`` and ``optimizer.step()``: waits for gradient copies, makes sure no
        weight stays on the device, and hands host gradients to ``param.grad`` (optimizer offload)."""
        # No device-wide sync here: with adapters trained on the device the host queues the optimizer and the
        # next step behind the backward (no idle device while it does). Host gradients are waited for one by
        # one, by their own copy events (hand_over_grad), before the CPU optimizer reads them.
        for offloader in self._offloaders.values():
            if offloader.holds == 0:
                offloader.offload()
        for offloader in self._offloaders.values():
            if isinstance(offloader, TrainableParamOffloader):
                offloader.hand_over_grad()
        self._copies.end_step()
        if self.activations is not None:
            self.activations.end_step()
        if self._stepper is not None:
            self._stepper.end_backward()
        self._end_step()

    def after_forward(self) -> None:
        """Call after a forward pass that no backward follows (inference, or encoding under ``no_grad``), as
        ``after_backward`` is called after a training step: the first call fixes the recorded order, which
        starts prefetching and applies ``gpu_memory_budget``. Without it a model that is only ever run
        forward streams every unit on demand, one after another, and keeps nothing resident."""
        for offloader in self._offloaders.values():
            if offloader.holds == 0:
                offloader.offload()
        self._copies.end_step()
        self._end_step()

    @contextlib.contextmanager
    def hold_for_inference(self, working_bytes: int) -> Iterator[InferenceHold]:
        """Within the block, the units that stream (all the budget does not keep) stay on the device, each copied
        once on entry and dropped on exit, as many as fit: for a forward-only phase that runs every unit many
        times and keeps nothing for a backward (a decode loop), which ``working_bytes`` of its own memory (a KV
        cache, logits) must fit beside. Those that do not fit stream per forward as before.

        The room is ``gpu_memory_limit`` (without one, on CUDA, what the process reserves plus what the device
        has free; off CUDA, no bound) less what the device holds now (the ring, kept units, adapters: the
        engine's count, or the allocator's where larger), ``working_bytes`` and the margin the measured budget
        keeps too (1/16 of the ceiling, at least 512 MiB).

        Example:
            >>> with manager.hold_for_inference(kv_cache_bytes) as hold:
            ...     completions = generate(model, prompts, ...)
            >>> hold.describe()   # "generation kept 32 of 32 streamed units on the device (...)"
        """
        hold = hold_units(self.units, self._schedule.kept, self._inference_room(working_bytes))
        self._schedule.plan_forward_prefetch()  # the held units need no prefetch, and prefetch nothing held
        try:
            yield hold
        finally:
            release_units(hold)
            self._schedule.plan_forward_prefetch()
            self._after_inference_hold(hold)

    def _inference_room(self, working_bytes: int) -> int | None:
        """Bytes the streamed units may take on the device during a forward-only phase (None: no bound)."""
        ceiling = parse_bytes(self.options.gpu_memory_limit)
        cuda = self.device.type == "cuda"
        if ceiling is None and cuda:
            free, _total = torch.cuda.mem_get_info(self.device)
            ceiling = torch.cuda.memory_reserved(self.device) + free
        if ceiling is None:
            return None
        in_use = self.ring.nbytes + self._stats.device_bytes
        if cuda:
            in_use = max(in_use, torch.cuda.memory_allocated(self.device))
        return ceiling - in_use - working_bytes - auto_budget.margin_bytes(ceiling)

    def _after_inference_hold(self, hold: InferenceHold) -> None:
        """The held units' memory goes back to the device, and a budget still being measured ('auto') does not
        count the phase's peak as training's: it measures what training needs besides the weights."""
        if not hold.units or self.device.type != "cuda":
            return
        if self.options.gpu_memory_budget == auto_budget.AUTO_BUDGET and self.measured_budget is None:
            torch.cuda.empty_cache()  # a CPU-GPU sync point, once per held phase while the budget is measured
            auto_budget.start_measuring(self.device)

    def _end_step(self) -> None:
        first_step = self._schedule.recording
        budget = self.options.gpu_memory_budget  # an int, None or "auto" (OffloadOptions.__post_init__)
        measured = budget == auto_budget.AUTO_BUDGET
        # What the trainables kept on the device with their optimizer took of a set budget is spent (plan.py).
        left = None if measured else max((parse_bytes(budget) or 0) - self.plan.device_trainable_bytes, 0)
        self._schedule.end_step(left)
        if self.disk_stage is not None:
            self.disk_stage.end_step()  # a recorded step's reads become the order read ahead
        applied = first_step
        if measured and self._schedule.step == auto_budget.MEASURED_AFTER_STEPS:
            # No unit is held between steps: the measured budget is applied as a set one is after step 1.
            self.measured_budget = auto_budget.measured_budget(self.device, parse_bytes(self.options.gpu_memory_limit))
            log.info("gpu_memory_budget 'auto': %s bytes after step %d", self.measured_budget, self._schedule.step)
            if self.measured_budget:
                self._schedule.apply_budget(self.measured_budget)
                applied = True
        if applied:
            self._stats.kept_resident_bytes = self._schedule.kept_bytes
            self._router.stop_routing(self._schedule.kept)  # on the device for good: no tokens for them
            # The planned slots counted every unit; the units the budget keeps resident no longer take turns
            # in them, so the ones that still stream take their class's slots in turn again (two units
            # copied one after the other never share a slot).
            # A unit the budget holds from forward to backward has left the ring too.
            streaming = [u for u in self._schedule.order if u.streams and u.in_ring]
            self.ring.reassign([self._placements[id(u)] for u in streaming if id(u) in self._placements])
            if self.disk_stage is not None:
                self.disk_stage.record_next_step()  # the schedule changed: so do the reads it makes

    def stats(self) -> OffloadStats:
        """Bytes moved each way, copies made, pinned memory reserved vs requested, device bytes held."""
        arenas = list({id(a): a for a in (self.arena, self.frozen_arena)}.values())  # a shared one counts too
        reserved, requested = sum(a.reserved_bytes for a in arenas), sum(a.requested_bytes for a in arenas)
        optimizer = self._stepper.state_bytes() if self._stepper is not None else 0
        stage = self.disk_stage
        if stage is not None:  # the staging ring is pinned host memory too
            reserved, requested = reserved + stage.nbytes, requested + stage.nbytes
        if self.activations is None:
            snapshot = dataclasses.replace(self._stats.snapshot(reserved, requested), optimizer_host_bytes=optimizer)
        else:
            saved = self.activations
            snapshot = dataclasses.replace(
                self._stats.snapshot(reserved + saved.arena.reserved_bytes, requested + saved.arena.requested_bytes),
                activation_offloaded_bytes=saved.offloaded_bytes,
                activation_host_bytes=saved.peak_held_bytes,
                optimizer_host_bytes=optimizer,
            )
        swap = self._stepper.swap if self._stepper is not None else None
        if swap is not None:
            snapshot = dataclasses.replace(
                snapshot,
                optimizer_swap_bytes=swap.swapped_bytes,
                optimizer_swap_read_bytes=swap.read_bytes,
                optimizer_swap_written_bytes=swap.written_bytes,
                optimizer_swap_wait_seconds=swap.wait_seconds,
            )
        if stage is None:
            return snapshot
        return dataclasses.replace(
            snapshot,
            disk_weight_bytes=self.plan.disk_bytes,
            staging_bytes=stage.nbytes,
            disk_read_bytes=stage.read_bytes,
            disk_read_seconds=stage.read_seconds,
            disk_wait_seconds=stage.wait_seconds,
        )

    def remove(self, copy: bool = True) -> nn.Module:
        """Detach every hook and leave ``model`` an ordinary CPU model holding the trained values.

        ``copy=False`` leaves its frozen tensors as views of the engine's host copies instead of copying each
        into memory of its own: for a model that is dropped next (a job's end), whose weights would otherwise
        exist twice in host memory at once (a 32B model's 64 GB more). Weights on the disk tier are read back
        from their files with ``copy=True`` and left as views of their files' maps with ``copy=False``."""
        if self._stepper is not None:
            self._stepper.detach(copy)
            for offloader in self._offloaders.values():
                if isinstance(offloader, TrainableParamOffloader):
                    offloader.before_read = None
            self._stepper = None
        synchronize(self.device)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for offloader in self._offloaders.values():
            offloader.detach(copy)
        self._offloaders.clear()
        self.units = []
        if self.disk_stage is not None:
            self.disk_stage.close()  # a weight left as a view of its file's map keeps the map alive
        if self._previous_limit is not None:
            torch.cuda.set_per_process_memory_fraction(self._previous_limit, self.device)
        return self.model

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for offloader in self._offloaders.values():
            kinds[offloader.kind] = kinds.get(offloader.kind, 0) + offloader.nbytes
        return (
            f"OffloadTrainingManager(device={self.device}, units={len(self.units)}, bytes_by_kind={kinds}, "
            f"pinned_reserved={self.arena.reserved_bytes})"
        )


def _check_model(model: nn.Module, allow_meta: bool = False) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if next(model.parameters(), None) is None:
        raise ValueError("model has no parameters; there is nothing to offload or train")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type != "cpu" and not (allow_meta and tensor.is_meta):
            raise ValueError(
                f"model tensor {name!r} is on {tensor.device}; the manager expects the model on the CPU "
                "(call model.to('cpu') before creating OffloadTrainingManager)"
            )


def _memory_fraction(device: torch.device) -> float | None:
    """The process's current memory fraction on ``device`` (restored by ``remove``); None off CUDA."""
    if device.type != "cuda":
        return None
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return getter(device) if getter is not None else 1.0


def _frozen_host_bytes(model: nn.Module) -> int:
    """The host bytes of ``model``'s frozen parameters (quantized ones as stored), aligned as the arena carves
    them: what a separate arena for them should expect."""
    unique = {id(p): p for p in model.parameters() if not p.requires_grad}.values()
    return sum(aligned(stored_bytes(p) if is_quantized(p) else p.numel() * p.element_size()) for p in unique)
