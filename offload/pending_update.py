"""A parameter's pending CPU update, the one-parameter view of the user's optimizer that runs it, and the
worker thread with its own intra-op thread count (``optimizer_step.py`` schedules them)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from offload.trainable import TrainableParamOffloader


def one_parameter_view(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor
) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` that steps only ``param`` (one group; hyperparameters refreshed before
    each step)."""
    single = copy.copy(optimizer)
    single.__dict__.pop("step", None)  # a scheduler's wrapper of step() is bound to the original optimizer
    single.__dict__.pop("zero_grad", None)
    single.param_groups = [{**group, "params": [param]}]
    return single


class PendingUpdate:
    """One parameter's pending update: which gradient buffer it reads and which host copy it writes."""

    __slots__ = ("copy_from", "done", "grad", "hyper", "offloader", "queued", "snapshot", "target")

    def __init__(
        self, offloader: TrainableParamOffloader, grad: torch.Tensor, target: torch.Tensor, hyper: dict[str, Any]
    ) -> None:
        self.offloader = offloader
        self.grad = grad
        self.target = target
        # The group's hyperparameters when the step's gradient was made: an LR scheduler steps the group
        # before this update runs.
        self.hyper = hyper
        self.copy_from: torch.Tensor | None = None  # delayed: the published weights, copied by the CPU first
        self.snapshot: torch.cuda.Event | None = None  # delayed: the copy engine's copy of them into ``target``
        self.queued = False
        self.done = threading.Event()


def start_worker(work: Callable[[], None], threads: int) -> threading.Thread:
    """The worker thread, with ``threads`` intra-op threads of its own. ``torch.set_num_threads`` sets the
    calling thread's OpenMP team size and a process-wide default for threads not yet started; the default is
    put back from this thread, so only the worker runs with ``threads``."""
    previous = torch.get_num_threads()
    ready = threading.Event()

    def run() -> None:
        torch.get_num_threads()  # this thread's lazy intra-op set-up first: it would re-read the process default
        torch.set_num_threads(threads)
        ready.set()
        work()

    worker = threading.Thread(target=run, name="ferry-optimizer", daemon=True)
    worker.start()
    ready.wait()
    torch.set_num_threads(previous)
    return worker
