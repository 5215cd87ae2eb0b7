"""Step the CPU optimizer per parameter in the background, overlapped with the GPU (optimizer offload only).

Each parameter's update runs on one worker thread as soon as its gradient has reached the host, while the
GPU continues backward. ``optimizer.step()`` returns at once; the next forward waits, parameter by
parameter, only for the updates it is about to read (``before_read``). The worker takes the landed
gradient whose parameter the next forward needs first: backward produces the last layer's gradient first,
and the forward needs the first layer first, so in arrival order the forward would wait for every update.

``delayed_update`` (ZeRO-Offload's delayed parameter update): after ``warmup_steps`` exact steps, step t's
update runs during step t+1's forward and backward, which read the weights from before it; its result is
published when step t+2 first reads the parameter. The GPU then waits for the CPU only when one update
takes longer than a whole step. Gradients are one step stale: step t+1's gradient is computed at weights
that do not include step t's update. The update writes a second host copy (``TrainableParamOffloader``
keeps two) so a copy to the device never reads a half-updated weight.

The user's optimizer keeps its state; a one-parameter copy of it (same class, hyperparameters re-read from
the user's group at each step, the same per-parameter state) steps a stand-in over the host copy, never the
parameter itself, whose ``.data`` the main thread swaps meanwhile. Global-norm gradient clipping needs every
gradient before any step, so it cannot be combined with this.

With an optimizer shard (shards.py) each update steps this process's part of the master, with that part of the
gradient, and the optimizer's state has the part's shape; ``optimizer.step()`` then waits for every update and
runs ``after_step`` (the data-parallel caller gathers the other ranks' parts there), so the next forward reads
whole weights. The delayed update is not combined with a shard: its second host copy would need gathering too.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from offload.optimizer_swap import OptimizerSwap
from offload.pending_update import PendingUpdate, one_parameter_view, start_worker

if TYPE_CHECKING:
    from offload.trainable import TrainableParamOffloader

log = logging.getLogger(__name__)


def same_hyperparameters(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two updates' group hyperparameters are equal (values may be tensors, such as a tensor ``lr``)."""
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True


class StepDuringBackward:
    """Runs ``optimizer``'s update per parameter on a worker thread, overlapped with the GPU.

    Args:
        optimizer: the user's optimizer over trainable parameters that the manager keeps on the host.
        offloaders: the manager's offloaders of those parameters, by ``id(param)``.
        accumulation_steps: backward passes per optimizer step; the update runs during the last one.
        priority: the forward position of a parameter's first use (lower runs first); ``None`` if unknown.
        delayed_update: switch to the delayed parameter update after ``warmup_steps`` exact steps.
        warmup_steps: exact optimizer steps before ``delayed_update`` takes effect.
        cpu_threads: intra-op threads of the worker's updates; ``None``: all but one, which is left to the
            thread that drives the GPU (a parallel update waits for its slowest thread, so one thread that
            shares a core with the training loop slows the whole update).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        offloaders: dict[int, TrainableParamOffloader],
        accumulation_steps: int = 1,
        *,
        priority: Callable[[TrainableParamOffloader], int | None] | None = None,
        delayed_update: bool = False,
        warmup_steps: int = 10,
        cpu_threads: int | None = None,
        on_device: frozenset[int] = frozenset(),
        after_step: Callable[[], None] | None = None,
        swap: OptimizerSwap | None = None,
    ) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1; got {accumulation_steps}")
        if warmup_steps < 0:
            raise ValueError(f"delayed_update warmup_steps must be >= 0; got {warmup_steps}")
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1; got {cpu_threads}")
        if delayed_update and any(o.part is not None for o in offloaders.values()):
            raise ValueError(
                "delayed_update cannot be combined with optimizer_shard: the delayed update's second host copy "
                "of each weight would have to be gathered across the ranks too; use exact updates"
            )
        self.optimizer = optimizer
        # The optimizer's state on disk (optimizer_swap.py): read before each update, written back after it.
        self.swap = swap
        # Run in optimizer.step() once every update of the step has finished (an optimizer shard's gather).
        self.after_step = after_step
        self.accumulation_steps = accumulation_steps
        self.delayed_update = delayed_update
        self.warmup_steps = warmup_steps
        self._priority = priority or (lambda offloader: None)
        self._group_of: dict[int, dict[str, Any]] = {}
        self._single: dict[int, torch.optim.Optimizer] = {}
        self._standin: dict[int, torch.nn.Parameter] = {}
        # Parameters the budget keeps on the device with their optimizer (plan.py): stepped there, in the
        # user's optimizer.step(), by a view of the optimizer over them alone.
        self._on_device: list[tuple[dict[str, Any], list[torch.Tensor]]] = []
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if id(p) in on_device]
            if kept:
                self._on_device.append((group, kept))
        self._device_view = one_parameter_view(optimizer, {}, torch.empty(0)) if self._on_device else None
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in on_device:
                    continue
                if id(param) not in offloaders:
                    raise ValueError(
                        "attach_optimizer needs every parameter of the optimizer to be a trainable parameter the "
                        "manager keeps on the CPU (enable_optimizer_cpu_offload=True) or with its optimizer on the "
                        "device (gpu_memory_budget); one is neither"
                    )
                self._group_of[id(param)] = group
                self._standin[id(param)] = standin = torch.nn.Parameter(torch.empty(0))
                self._single[id(param)] = one_parameter_view(optimizer, group, standin)
        self._offloaders = [offloaders[key] for key in self._group_of]
        self._latest: dict[int, PendingUpdate] = {}  # id(offloader) -> its newest queued update
        self._queue: list[PendingUpdate] = []
        self._held: list[PendingUpdate] = []  # delayed mode: gradients waiting for the next step's first read
        self._read: set[int] = set()  # parameters read since the last optimizer step
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closing = False
        self._backwards = 0
        self.optimizer_steps = 0
        self.busy_seconds = 0.0  # the worker's time in updates (reported by the benchmark)
        self.wait_seconds = 0.0  # the main thread's time waiting for updates before reading weights
        self.compute_seconds = 0.0  # of busy_seconds, the time in the optimizer's kernels (not waiting for copies)
        self.copy_seconds = 0.0  # of busy_seconds, delayed: the CPU copying published weights (no device read)
        self.cpu_copies = 0
        self.optimizer_calls = 0  # calls of the optimizer's step (one per batch of a unit's updates)
        self.cpu_threads = cpu_threads if cpu_threads is not None else max(1, torch.get_num_threads() - 1)
        if swap is not None:  # a state already in memory (a checkpoint's, loaded before attaching) goes to disk now
            for offloader in self._offloaders:
                if self.optimizer.state.get(offloader.tensor):
                    swap.swap_out(id(offloader.tensor), offloader.name, self.optimizer.state[offloader.tensor])
        self._worker = start_worker(self._work, self.cpu_threads)
        self._wrap_optimizer()

    # ----------------------------------------------------------------- the user's optimizer
    def _wrap_optimizer(self) -> None:
        self._original_step = optimizer_step = self.optimizer.step
        self._original_zero_grad = self.optimizer.zero_grad

        def step(closure: Any = None) -> Any:
            return self._step(closure)

        def zero_grad(set_to_none: bool = True) -> None:
            # The gradient buffers belong to the background updates until they finish: gradients are always
            # released (set to None), never zeroed in place.
            for offloader in self._offloaders:
                offloader.release_grad()
            for _, params in self._on_device:
                for param in params:
                    param.grad = None

        # An LR scheduler checks that its own wrapper of step() is still in place; ours keeps its promise
        # (it sets ``_opt_called`` as that wrapper does).
        step._wrapped_by_lr_sched = getattr(optimizer_step, "_wrapped_by_lr_sched", False)  # type: ignore[attr-defined]
        self.optimizer.step = step  # type: ignore[method-assign]
        self.optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def _step(self, closure: Any = None) -> Any:
        """The user's ``optimizer.step()``: the updates are already queued; only a closure (which
        re-evaluates the loss) makes it a normal, synchronous step."""
        if closure is not None:
            if any(o.part is not None for o in self._offloaders):
                raise ValueError("optimizer.step(closure) needs whole gradients; with optimizer_shard each is a part")
            self.wait()
            return self._original_step(closure)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's wrapper sets
        if self._device_view is not None:
            # Exact even under delayed_update: the GPU's update is queued behind its backward and is short.
            # The groups' hyperparameters as they are now (an LR scheduler steps them after this call).
            self._device_view.param_groups = [{**group, "params": params} for group, params in self._on_device]
            type(self.optimizer).step(self._device_view)
        if self.after_step is not None:
            self.wait()  # this process's updates are all in its host masters
            self.after_step()
        return None

    # ----------------------------------------------------------------- what the manager tells us
    @property
    def stepping_now(self) -> bool:
        """True during the backward of the last micro-batch of an optimizer step."""
        return self._backwards % self.accumulation_steps == self.accumulation_steps - 1

    @property
    def delaying(self) -> bool:
        """The delayed parameter update is in effect (after the warm-up steps)."""
        return self.delayed_update and self.optimizer_steps >= self.warmup_steps

    def grad_ready(self, offloader: TrainableParamOffloader) -> None:
        """A gradient's last device->host copy is queued (post-accumulate-grad hook)."""
        if self.stepping_now and not self.delaying:
            offloader.fresh_grad = False
            self._enqueue(self._update(offloader, offloader.grad_host))
        # Delayed: the update is queued when the next step first reads the parameter (end_backward holds it).

    def end_backward(self) -> None:
        """Called by ``after_backward`` (every micro-batch), after the gradients are settled."""
        if self.stepping_now:
            fresh = [o for o in self._offloaders if o.fresh_grad]  # gradients not yet queued for an update
            for offloader in fresh:
                offloader.fresh_grad = False
            if self.delaying:
                # Kept until the parameter's next read; a step that skips the parameter keeps it waiting.
                self._held += [self._update(o, o.take_grad_for_update()) for o in fresh]
            else:  # used only in an earlier micro-batch of this step
                for offloader in fresh:
                    self._enqueue(self._update(offloader, offloader.grad_host))
            self.optimizer_steps += 1
            self._read.clear()
        self._backwards += 1

    def before_read(self, offloader: TrainableParamOffloader) -> None:
        """Before the first copy of ``offloader``'s host weights to the device in a step: wait for its
        pending update; in delayed mode publish the finished one and start the held gradient's update."""
        if id(offloader) not in self._read:
            self._read.add(id(offloader))
            self._settle(offloader, reading=True)

    def _settle(self, offloader: TrainableParamOffloader, reading: bool) -> None:
        update = self._latest.pop(id(offloader), None)
        if update is not None:
            if not update.queued:  # its weights were never read on the device: the CPU copies them
                offloader.cancel_snapshot()
                update.copy_from = offloader.host
                self._enqueue(update)
            self._wait_for(update)
            if update.target is not offloader.host:
                offloader.publish(update.target)  # delayed: the update wrote the spare copy
        held = next((u for u in self._held if u.offloader is offloader), None)
        if held is not None:
            self._held.remove(held)
            held.target = offloader.spare()  # the update continues from the published weights, in the spare
            if reading:  # the device copy this read makes is copied back into the spare; then it is queued
                self._latest[id(offloader)] = held
                offloader.snapshot_next_read(held.target, functools.partial(self._snapshot_queued, held))
            else:
                held.copy_from = offloader.host
                self._enqueue(held)

    def _snapshot_queued(self, update: PendingUpdate, event: torch.cuda.Event | None) -> None:
        update.snapshot = event
        self._enqueue(update)

    def wait(self) -> None:
        """Finish every update, queued and held, and publish the results (before a checkpoint, at remove).
        In delayed mode this applies the held gradients now: the next step reads the newest weights."""
        while self._latest or self._held:
            pending = next(iter(self._latest.values())) if self._latest else self._held[0]
            self._settle(pending.offloader, reading=False)

    # ----------------------------------------------------------------- the worker
    def _update(self, offloader: TrainableParamOffloader, grad: torch.Tensor) -> PendingUpdate:
        group = self._group_of[id(offloader.tensor)]
        return PendingUpdate(offloader, grad, offloader.host, {k: v for k, v in group.items() if k != "params"})

    def _enqueue(self, update: PendingUpdate) -> None:
        self._latest[id(update.offloader)] = update
        update.queued = True
        with self._cond:
            self._queue.append(update)
            self._cond.notify()

    def _wait_for(self, update: PendingUpdate) -> None:
        if not update.done.is_set():
            start = time.perf_counter()
            update.done.wait()
            self.wait_seconds += time.perf_counter() - start
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the CPU optimizer step failed on its worker thread: {error}") from error

    def _next(self) -> list[PendingUpdate]:
        """The landed gradient whose parameter the next forward reads first (else the oldest, whose copy lands
        first: the device->host stream runs in order), with the other landed gradients of its unit that share
        its hyperparameters: one optimizer call steps them all. A layer's weight and bias then cost one call,
        not two (each call's Python overhead is a fixed cost beside a small update's arithmetic), and the
        forward, which reads a unit's parameters together, waits no longer. Empty when the worker closes."""
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return []
            landed = [u for u in self._queue if u.offloader.grad_landed()]
            ranked = [u for u in landed if self._priority(u.offloader) is not None]
            if ranked:
                choice = min(ranked, key=lambda u: self._priority(u.offloader))  # type: ignore[arg-type, return-value]
            else:
                choice = landed[0] if landed else self._queue[0]
            batch = [choice]
            unit = self._priority(choice.offloader)
            if unit is not None:
                group = self._group_of[id(choice.offloader.tensor)]
                batch += [
                    u
                    for u in ranked
                    if u is not choice
                    and self._priority(u.offloader) == unit
                    and self._group_of[id(u.offloader.tensor)] is group
                    and same_hyperparameters(u.hyper, choice.hyper)
                ]
            if self.swap is not None:  # each parameter updated holds a slot of the swap ring meanwhile
                batch = batch[: self.swap.batch_limit]
            for update in batch:
                self._queue.remove(update)
            return batch

    def _work(self) -> None:
        while batch := self._next():
            start = time.perf_counter()
            try:
                for update in batch:
                    if update.grad is update.offloader.grad_host:  # exact: the copy may still be in flight
                        update.offloader.settle_grad()
                    # (A delayed update's gradient was settled by after_backward; the offloader's current copy
                    # event belongs to the next step's gradient, which this update must not wait for.)
                    if update.snapshot is not None:
                        update.snapshot.synchronize()  # the published weights, copied back into the spare
                    elif update.copy_from is not None:
                        copying = time.perf_counter()
                        update.target.copy_(update.copy_from)
                        self.copy_seconds += time.perf_counter() - copying
                        self.cpu_copies += 1
                computing = time.perf_counter()
                self._step_together(batch)
                self.compute_seconds += time.perf_counter() - computing
            except BaseException as error:  # re-raised on the main thread by the next wait
                log.exception("CPU optimizer step failed")
                if self._error is None:  # the first failure is the cause; later ones follow from it
                    self._error = error
            finally:
                self.busy_seconds += time.perf_counter() - start
                self.optimizer_calls += 1
                for update in batch:
                    update.done.set()

    def _step_together(self, batch: list[PendingUpdate]) -> None:
        """One call of the optimizer's one-parameter view, widened to ``batch``'s stand-ins (same group and
        hyperparameters). Each stand-in's data is its update's target and its state the user's entry for the
        parameter, so the optimizer reads and writes exactly what per-parameter calls would; an elementwise
        optimizer (Adam, AdamW, SGD, ...) computes the same bits for a tensor whichever list it is in."""
        standins = []
        state = {}
        for update in batch:
            param = update.offloader.tensor
            standin = self._standin[id(param)]
            standin.data = update.offloader.own(update.target)  # the master, or this process's part of it
            standin.grad = update.grad
            state[standin] = self.optimizer.state[param]  # the user's entry, shared
            standins.append(standin)
        single = self._single[id(batch[0].offloader.tensor)]
        own = single.param_groups[0]["params"]
        single.state = state  # type: ignore[assignment]
        single.param_groups[0].update(batch[0].hyper)
        single.param_groups[0]["params"] = standins
        swap = self.swap
        if swap is not None:  # the state's entries point into the swap ring for the update
            for update in batch:
                swap.swap_in(id(update.offloader.tensor), self.optimizer.state[update.offloader.tensor])
        try:
            single.step()
        finally:
            single.param_groups[0]["params"] = own
            for standin in standins:
                standin.grad = None
        if swap is not None:  # written back; the entries point at the files again
            for update in batch:
                param = update.offloader.tensor
                swap.swap_out(id(param), update.offloader.name, self.optimizer.state[param])

    def state_bytes(self) -> int:
        """Host bytes of the optimizer's state for the parameters updated here (AdamW's moments and steps);
        with the state on disk, its swap ring and the scalars kept in memory."""
        total = 0 if self.swap is None else self.swap.ring_bytes
        swapped = set() if self.swap is None else {id(o.tensor) for o in self._offloaders} & self.swap.files.keys()
        for offloader in self._offloaders:
            state = self.optimizer.state.get(offloader.tensor)  # .get: the state is a defaultdict
            # list(): one C-level copy, safe while the worker thread adds a first step's entries
            for value in list(state.values()) if state else ():
                on_disk = id(offloader.tensor) in swapped and value.dim() > 0
                if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not on_disk:
                    total += value.numel() * value.element_size()
        return total

    def wait_for_swap(self) -> None:
        """Every update finished and its state written to its swap file (before the state is read directly)."""
        self.wait()
        if self.swap is not None:
            self.swap.flush()

    def detach(self, copy: bool = True) -> None:
        """Finish and publish every update, stop the worker, give the optimizer its own methods back. With the
        state on disk: ``copy`` reads it back into memory of its own; otherwise it stays views of its files' maps
        (whose files are removed: the maps keep them readable)."""
        self.wait()
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._worker.join()
        if self.swap is not None:
            if self.swap.failed is None:  # a failed swap was raised already: its state is not read back
                self.swap.flush()
            if copy and self.swap.failed is None:
                for offloader in self._offloaders:
                    self.swap.take_in_memory(self.optimizer.state[offloader.tensor], id(offloader.tensor))
            self.swap.close()
            self.swap.remove_files()
        self.optimizer.step = self._original_step  # type: ignore[method-assign]
        self.optimizer.zero_grad = self._original_zero_grad  # type: ignore[method-assign]
