"""Step the CPU optimizer for each parameter as soon as its gradient reaches the host, while backward
continues on the GPU (optimizer offload only).

The user's optimizer keeps its state; a one-parameter copy of it (same class, same hyperparameters read from
the user's param group at each step, the user's ``state`` dict shared) runs the update on a worker thread.
The user's ``optimizer.step()`` then only waits for that work. Global-norm gradient clipping needs every
gradient before any step, so it cannot be combined with this.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from offload.offloaders import TrainableParamOffloader


def _one_parameter_view(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor
) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` that steps only ``param``: it shares the state dict and hooks, and
    has one group holding that parameter (its hyperparameters are refreshed before each step)."""
    single = copy.copy(optimizer)
    single.__dict__.pop("step", None)  # a scheduler's wrapper of step() is bound to the original optimizer
    single.param_groups = [{**group, "params": [param]}]
    return single


class StepDuringBackward:
    """Runs ``optimizer``'s update per parameter on a worker thread during the last micro-batch's backward.

    Attach after creating any LR scheduler (schedulers wrap ``optimizer.step`` when they are made).

    Args:
        optimizer: the user's optimizer over trainable parameters that the manager keeps on the host.
        offloaders: the manager's offloaders of those parameters, by ``id(param)``.
        accumulation_steps: backward passes per optimizer step; the update runs during the last one.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        offloaders: dict[int, TrainableParamOffloader],
        accumulation_steps: int = 1,
    ) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1; got {accumulation_steps}")
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self._group_of: dict[int, dict[str, Any]] = {}
        self._single: dict[int, torch.optim.Optimizer] = {}
        self._standin: dict[int, torch.nn.Parameter] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in offloaders:
                    raise ValueError(
                        "attach_optimizer needs every parameter of the optimizer to be a trainable parameter the "
                        "manager keeps on the CPU (enable_optimizer_cpu_offload=True); one is not"
                    )
                self._group_of[id(param)] = group
                self._standin[id(param)] = standin = torch.nn.Parameter(offloaders[id(param)].host)
                self._single[id(param)] = _one_parameter_view(optimizer, group, standin)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferry-optimizer")
        self._pending: list[Future] = []
        self._backwards = 0
        self._stepped_this_cycle = False
        self._original_step = optimizer.step

        def step(closure: Any = None) -> Any:
            return self._step(closure)

        # An LR scheduler checks that its own wrapper of step() is still in place; ours keeps its promise
        # (it sets ``_opt_called`` as that wrapper does).
        step._wrapped_by_lr_sched = getattr(self._original_step, "_wrapped_by_lr_sched", False)  # type: ignore[attr-defined]
        optimizer.step = step  # type: ignore[method-assign]

    @property
    def stepping_now(self) -> bool:
        """True during the backward of the last micro-batch of an optimizer step."""
        return self._backwards % self.accumulation_steps == self.accumulation_steps - 1

    def grad_ready(self, offloader: TrainableParamOffloader) -> None:
        """A gradient's host copy is queued; step its parameter once the copy lands."""
        if self.stepping_now:
            self._stepped_this_cycle = True
            self._pending.append(self._worker.submit(self._step_one, offloader))

    def _step_one(self, offloader: TrainableParamOffloader) -> None:
        offloader.settle_grad()  # waits for this gradient's copy (the GIL is released while waiting)
        param = offloader.tensor
        # The update goes to the host master through a stand-in over it, never through ``param``: the
        # parameter may still point at a device copy (a prefetch, a held unit) while backward continues,
        # and the main thread may swap its ``.data`` meanwhile. The stand-in shares the user's state entry.
        standin = self._standin[id(param)]
        single = self._single[id(param)]
        single.state = {standin: self.optimizer.state[param]}
        single.param_groups[0].update({k: v for k, v in self._group_of[id(param)].items() if k != "params"})
        standin.grad = offloader.grad_host
        single.step()
        standin.grad = None

    def end_backward(self) -> None:
        """Called by ``after_backward``: count the micro-batch."""
        self._backwards += 1

    def wait(self) -> None:
        """Block until every queued update is done (re-raising an error from the worker)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _step(self, closure: Any = None) -> Any:
        """The user's ``optimizer.step()``: wait for the updates made during backward (or step normally
        when none ran, or with a closure, which re-evaluates the loss)."""
        self.wait()
        if self._stepped_this_cycle and closure is None:
            self._stepped_this_cycle = False
            self.optimizer._opt_called = True  # what an LR scheduler's wrapper of step() would have set
            return None
        return self._original_step() if closure is None else self._original_step(closure)

    def detach(self) -> None:
        self.wait()
        self.optimizer.step = self._original_step  # type: ignore[method-assign]
        self._worker.shutdown(wait=True)
