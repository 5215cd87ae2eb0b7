"""One attempt of a job inside a Ray worker process: the body of the Ray executor's task.

No Ray import here: the executor wraps ``RemoteJob`` with ``ray.remote``. Ray runs it as a threaded actor,
so ``take_events`` and ``request_stop`` are answered while ``run`` trains on another thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from typing import Any

from service.workers.executor.base import LaunchRequest, StopKind
from service.workers.executor.child import log_to_file, run_attempt

log = logging.getLogger("ferry.job")


class RemoteJob:
    """Runs ``jobs.run_job`` for one attempt and holds its events until the service takes them.

    Events are buffered here rather than written to the service's SQLite file, which lives on the
    service's disk (SQLite over NFS is not safe). The service long-polls ``take_events`` and stores each
    batch, in order, exactly as a local job's process would have.

    Example:
        job = ray.remote(RemoteJob).options(num_gpus=1, max_concurrency=4).remote(request)
        done = job.run.remote()
        events = ray.get(job.take_events.remote(timeout_s=1.0))
    """

    def __init__(self, request: LaunchRequest, *, hide_gpus: bool) -> None:
        if hide_gpus:  # a CPU job on a GPU node; set before anything can initialise CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        self._request = request
        self._events: deque[dict[str, Any]] = deque()
        self._ready = threading.Condition()
        self._stop: StopKind | None = None

    def where(self) -> dict[str, Any]:
        """The node and process running the job (for the job's log and /v1/workers)."""
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def run(self) -> int:
        """Train until the job ends; 0 when it ended by itself, 1 when it raised (a ``failed`` event says why)."""
        request = self._request
        log_to_file(request, capture_stdio=False)
        log.info(
            "job %s attempt %d starting on %s in pid %d (Ray) with CUDA_VISIBLE_DEVICES=%r",
            request.job_id,
            request.attempt,
            socket.gethostname(),
            os.getpid(),
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
        code = run_attempt(request, self, lambda: self._stop)
        logging.shutdown()
        return code

    def append_events(self, job_id: str, attempt: int, events: list[dict[str, Any]]) -> None:
        """The sink ``run_attempt`` reports into (an `EventSink`)."""
        with self._ready:
            self._events.extend(events)
            self._ready.notify_all()

    def take_events(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every event not taken yet, oldest first; waits up to ``timeout_s`` for one when there are none."""
        with self._ready:
            self._ready.wait_for(lambda: bool(self._events), timeout=timeout_s)
            taken = list(self._events)
            self._events.clear()
        return taken

    def request_stop(self, kind: StopKind) -> None:
        """Seen by the job between steps: ``pause`` checkpoints first, ``cancel`` does not."""
        if self._stop != "cancel":  # a cancel is never downgraded to a pause
            self._stop = kind
