"""Starting a data-parallel job's ranks with torch's elastic launcher, and relaying rank 0's events.

The job's process (the service's child, or a caller of ``run_job``) becomes the launcher: it starts
``world_size`` rank processes (spawned, rendezvous on 127.0.0.1 on a free port, no restarts: a lost rank
ends the attempt and the service resumes the job from its last checkpoint). Each rank runs the ordinary
``run_job``. Rank 0's events come back through a queue and go to the caller's ``report`` from a relay
thread, which also polls the caller's ``should_stop`` and publishes the answer in a shared value that rank 0
reads and broadcasts to the others before every step.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from jobs.distributed.group import STOP_CODES, StopRequest, join_group, leave_group
from jobs.errors import RankLost
from jobs.events import FailedEvent, Report, StopPoll, failed_event

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the relay forwards a stop request and how long an event may wait in the queue
ALL_RANKS_GRACE_S = 2.0  # a failed rank waits this long before exiting, for the others to report theirs
PR_SET_PDEATHSIG = 1  # prctl(2)


def run_ranks(
    spec: Any,
    run_rank: Callable[..., Any],
    *,
    output_dir: Path,
    report: Report,
    resume: bool,
    should_stop: StopPoll | None,
    cache_dir: Path | str | None = None,
) -> Any:
    """Run ``run_rank`` on ``spec.distributed.world_size`` ranks of this machine; returns rank 0's result.

    ``run_rank`` is called in each rank as ``run_rank(spec, output_dir=, report=, resume=, should_stop=,
    cache_dir=)`` (the runner's ``run_job``); a module-level function, passed to the ranks by its name.

    Raises:
        RankLost: a rank ended without rank 0 reporting why (killed, crashed, or another rank raised);
            reported as an ``interrupted`` failure, so the service resumes the job from its last checkpoint.
        RuntimeError: rank 0 raised first; its ``failed`` event has been reported.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world_size = spec.distributed.world_size
    context = multiprocessing.get_context("spawn")  # the launcher's start method: CUDA does not survive fork
    events, stop = context.Queue(), context.Value("i", 0)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"ferry-{uuid.uuid4().hex}",
        rdzv_backend="c10d",  # torchrun --standalone: the rendezvous store lives in this process
        rdzv_endpoint="127.0.0.1:0",  # a free port
        max_restarts=0,  # a lost rank ends the attempt; the service resumes from the last checkpoint
        monitor_interval=POLL_S,
        start_method="spawn",
    )
    relay = _Relay(events, stop, report, should_stop)
    relay.start()
    try:
        cache = str(cache_dir) if cache_dir is not None else None
        target = f"{run_rank.__module__}:{run_rank.__qualname__}"
        results = elastic_launch(config, rank_main)(target, spec, str(output_dir), resume, events, stop, cache)
    except ChildFailedError as error:
        relay.finish()
        rank, failure = error.get_first_failure()
        same = _one_error_of_every_rank(relay.rank_failures, world_size)
        if same is not None:  # every rank raised the same error: the job's own (a retry would raise it again)
            report(same)
            raise RuntimeError(f"every rank failed: {same.message}") from error
        if rank == 0 and failure.exitcode == 1 and relay.failure is not None:  # rank 0 raised first: its error
            report(relay.failure)
            raise RuntimeError(f"rank 0 failed: {relay.failure.message}") from error
        # Another rank first, or a signal: what rank 0 reported, if anything, followed from that.
        lost = RankLost(f"a rank of {world_size} ended without finishing: {_describe(rank, failure)}")
        report(failed_event(lost))
        raise lost from error
    relay.finish()
    return results[0]


@record  # a rank's exception reaches the launcher's ChildFailedError (its message names the rank's error)
def rank_main(
    target: str, spec: Any, output_dir: str, resume: bool, events: Any, stop: Any, cache_dir: str | None = None
) -> Any:
    """One rank: join the group, run ``target`` (``module:function``), leave. Rank 0 alone reports (into
    ``events``)."""
    _die_with_launcher()
    group = join_group(spec.device)
    logging.basicConfig(level=logging.INFO, format=f"rank {group.rank}: %(levelname)s %(name)s: %(message)s")
    module, _, name = target.partition(":")
    run_job = getattr(importlib.import_module(module), name)  # after joining: accelerate must not see the
    # launcher's variables, so the job's modules are imported here and the function travels by name

    codes: dict[int, StopRequest] = {value: key for key, value in STOP_CODES.items()}
    try:
        return run_job(
            spec,
            output_dir=Path(output_dir),
            report=_RankReport(group.rank, events),
            resume=resume,
            should_stop=lambda: group.stop_request(lambda: codes[stop.value]),
            cache_dir=cache_dir,
        )
    except BaseException:
        # The launcher ends every rank once one has exited: wait a moment, so that the others, if they hit the
        # same error, report it too and the job fails with it rather than as a lost rank.
        time.sleep(ALL_RANKS_GRACE_S)
        raise
    finally:
        leave_group()


@dataclass(frozen=True)
class _RankFailed:
    """A rank's ``failed`` event, queued with its rank (only rank 0's other events are reported)."""

    rank: int
    event: FailedEvent


@dataclass(frozen=True)
class _RankReport:
    """A rank's ``report``: rank 0 reports for the job; every rank's ``failed`` event goes to the launcher."""

    rank: int
    events: Any

    def __call__(self, event: Any) -> None:
        if isinstance(event, FailedEvent):
            self.events.put(_RankFailed(self.rank, event))
        elif self.rank == 0:
            self.events.put(event)


def _one_error_of_every_rank(failures: dict[int, FailedEvent], world_size: int) -> FailedEvent | None:
    """The error every rank reported, when all ``world_size`` reported the same one; else None."""
    if len(failures) != world_size:
        return None
    errors = {(f.error, f.exception, f.message) for f in failures.values()}
    return failures[0] if len(errors) == 1 else None


def _die_with_launcher() -> None:
    """End this rank when the process that launched it dies (a cancel that had to kill it): an orphaned rank
    would wait in a collective for ever, holding its GPU."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL


def _describe(rank: int, failure: Any) -> str:
    if failure.exitcode < 0:
        return f"rank {rank} (signal {failure.signal_name()})"
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
    return f"rank {rank} (exit code {failure.exitcode}{': ' + message if message else ''})"


class _Relay(threading.Thread):
    """Rank 0's events to ``report``, and the caller's stop requests to the ranks, until `finish`."""

    def __init__(self, events: Any, stop: Any, report: Report, should_stop: StopPoll | None) -> None:
        super().__init__(name="ferry-rank-relay", daemon=True)
        self.events, self.stop, self.report, self.should_stop = events, stop, report, should_stop
        self.failure: FailedEvent | None = None  # rank 0's
        self.rank_failures: dict[int, FailedEvent] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self._forward_stop()
            self._drain(timeout=POLL_S)

    def finish(self) -> None:
        """Stop relaying, after every event the ranks queued has been reported."""
        self._done.set()
        self.join()
        self._drain(timeout=0.0)

    def _forward_stop(self) -> None:
        wanted = STOP_CODES[self.should_stop()] if self.should_stop is not None else 0
        if wanted > self.stop.value:  # none < pause < cancel: a request is never taken back
            self.stop.value = wanted

    def _drain(self, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if isinstance(event, _RankFailed):  # held until the launch says which rank failed first
                self.rank_failures[event.rank] = event.event
                if event.rank == 0:
                    self.failure = event.event
                continue
            self.report(event)
