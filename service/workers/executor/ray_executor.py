"""Run each job as a Ray actor task on a cluster, one GPU (or a few CPUs) each; events come back through Ray.

Imported only when ``FERRY_EXECUTOR=ray``: Ray is an optional extra (``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import yaml
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jobs.events import LogEvent
from service.queue.store import JobStore
from service.workers.executor.base import LaunchRequest, StopKind
from service.workers.executor.remote_job import RemoteJob
from service.workers.placement import ranks_in

log = logging.getLogger("ferry.ray")

_POLL_S = 1.0  # how long one long-poll for events waits; bounds how late the service notices a lost node


class _Closing(Exception):
    """The executor is closing while a call to the actor is outstanding."""


class RayRunHandle:
    """A job's actor on the cluster, and the thread that moves its events into the store.

    ``exit_code()`` stays None until every event the job sent is stored, so the scheduler judges the
    attempt on its complete record, as for a local process.
    """

    def __init__(
        self, actor: Any, request: LaunchRequest, store_factory: Callable[[], JobStore], group: Any = None
    ) -> None:
        self._actor, self._request, self._group = actor, request, group  # group: the job's placement group
        self.pid: int | None = None  # the remote worker's pid, known once Ray has placed the actor
        self.started_at: float | None = None  # no local process to tell apart after a restart
        self.host: str | None = None
        self._code: int | None = None
        self._reason: str | None = None
        self._closing = threading.Event()
        self._done = actor.run.remote()
        self._thread = threading.Thread(
            target=self._pump, args=(store_factory,), daemon=True, name=f"ferry-ray-{request.job_id}"
        )
        self._thread.start()

    def exit_code(self) -> int | None:
        return self._code

    def exit_reason(self) -> str | None:
        return self._reason

    def request_stop(self, kind: StopKind) -> None:
        self._actor.request_stop.remote(kind)  # answered on the actor's spare thread, between steps

    def kill(self) -> None:
        ray.kill(self._actor, no_restart=True)

    def detach(self) -> None:
        """Stop waiting (the executor is closing); the actor dies with this driver."""
        self._closing.set()
        self._thread.join(timeout=2 * _POLL_S + 1)

    # -- the event pump (its own thread) -----------------------------------------------------------------

    def _pump(self, store_factory: Callable[[], JobStore]) -> None:
        store = store_factory()
        try:
            self._place(store)
            while self._code is None and not self._closing.is_set():
                self._store_events(store, self._get(self._actor.take_events.remote(_POLL_S)))
                ready, _ = ray.wait([self._done], timeout=0)
                if ready:  # the job returned: take what it sent after the last poll, then its exit code
                    self._store_events(store, self._get(self._actor.take_events.remote(0.0)))
                    self._code = ray.get(self._done)
        except _Closing:
            return
        except RayError as error:  # the actor died: its node was lost, its worker killed, or we killed it
            self._reason = f"its Ray worker died ({type(error).__name__}: {_first_line(error)})"
            self._code = 1
        except Exception as error:
            log.exception("event pump for %s failed", self._request.job_id)
            self._reason = f"the service lost track of its Ray task ({error})"
            self._code = 1
        finally:
            store.close()
            if self._code is not None:  # its process may linger idle after run() returned
                with contextlib.suppress(RayError):
                    ray.kill(self._actor, no_restart=True)
                if self._group is not None:  # the GPUs it reserved go back to the cluster
                    with contextlib.suppress(RayError):
                        remove_placement_group(self._group)

    def _place(self, store: JobStore) -> None:
        where = self._get(self._actor.where.remote())  # waits while Ray looks for a free GPU
        self.pid, self.host = where["pid"], where["host"]
        message = (
            f"attempt {self._request.attempt} runs on Ray node {where['host']} in pid {where['pid']} "
            f"(CUDA_VISIBLE_DEVICES={where['cuda_visible_devices']!r})"
        )
        store.append_event(self._request.job_id, self._request.attempt, LogEvent(level="info", message=message))

    def _get(self, ref: Any) -> Any:
        while True:
            try:
                return ray.get(ref, timeout=_POLL_S + 5.0)
            except GetTimeoutError:
                if self._closing.is_set():
                    raise _Closing from None

    def _store_events(self, store: JobStore, events: list[dict[str, Any]]) -> None:
        for event in events:
            store.append_event(self._request.job_id, self._request.attempt, event)


class RayExecutor:
    """Jobs as Ray actors: ``num_gpus=1`` for a CUDA job, and ``cpus_per_job`` CPUs for every job.

    The service is a Ray driver. Each attempt is a fresh actor (a fresh process, as CUDA wants) running
    the same ``jobs`` entry point as a local child; its outputs go to the job's directory, which must be on
    storage every node mounts at the same path (``FERRY_SHARED_DIR``). A lost node ends the attempt with
    no outcome event, which the scheduler turns into ``interrupted`` and a requeue from the last checkpoint.

    Example:
        executor = RayExecutor(address="auto", db_path=settings.db_path)
        handle = executor.launch(request)
        handle.request_stop("pause")
    """

    def __init__(self, *, address: str | None, db_path: Path, cpus_per_job: int = 4) -> None:
        if not ray.is_initialized():
            # No log_to_driver: each job writes its own log file; the service log stays the service's.
            ray.init(
                address=address,
                log_to_driver=False,
                include_dashboard=False if address is None else None,
                namespace="ferry",
            )
        self._db_path, self._cpus_per_job = db_path, cpus_per_job
        self._handles: list[RayRunHandle] = []
        self._remote_job = ray.remote(RemoteJob)

    def gpu_count(self) -> int:
        """The cluster's GPUs now: how many jobs it can run at once."""
        return int(ray.cluster_resources().get("GPU", 0))

    def launch(self, request: LaunchRequest) -> RayRunHandle:
        wants_gpu = self._wants_gpu(request.spec_text)
        # Ray sets OMP_NUM_THREADS to num_cpus, so a GPU job asks for CPUs too: a CPU-offloaded optimizer
        # step runs on them.
        ranks = ranks_in(request.spec_text) if wants_gpu else 1
        resources: dict[str, Any] = {"num_gpus": ranks if wants_gpu else 0, "num_cpus": self._cpus_per_job}
        group = None
        if ranks > 1:  # distributed.world_size: all its GPUs on one node, reserved together
            group = placement_group(
                rank_bundles(ranks, self._cpus_per_job), strategy="STRICT_PACK", name=f"ferry-{request.job_id}"
            )
            resources["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        actor = self._remote_job.options(
            **resources,
            max_concurrency=4,
            max_restarts=0,
            max_task_retries=0,
            name=f"ferry-{request.job_id}-{request.attempt}",
        ).remote(request, hide_gpus=not wants_gpu)
        handle = RayRunHandle(actor, request, self._open_store, group)
        self._handles = [h for h in self._handles if h.exit_code() is None] + [handle]
        return handle

    def keep_warm(self) -> None:
        return None  # each attempt is a fresh actor that Ray places; there is nothing to keep ready here

    def close(self) -> None:
        """Stop the event pumps and leave the cluster (it keeps running; our actors end with us)."""
        for handle in self._handles:
            handle.detach()
        self._handles.clear()
        ray.shutdown()

    def stop_orphan(self, pid: int | None, started_at: float | None, *, grace_s: float) -> None:
        # A job's actor belongs to the server that created it, and Ray ends an actor whose owner died: there
        # is no orphan to stop. The pid is on another node anyway; it must not be killed here.
        return None

    def _wants_gpu(self, spec_text: str) -> bool:
        # The spec passed validation at submit; only its device is read here.
        device = (yaml.safe_load(spec_text) or {}).get("device", "auto")
        return device == "cuda" or (device == "auto" and self.gpu_count() > 0)

    def _open_store(self) -> JobStore:
        return JobStore(self._db_path)


def rank_bundles(ranks: int, cpus: int) -> list[dict[str, float]]:
    """The placement group of a job of ``ranks`` GPUs: one bundle holding them all, packed on one node.

    One bundle, not one per GPU: the job is one actor (its process launches the ranks, one per GPU it sees),
    and an actor takes its resources from a single bundle. The group makes Ray reserve the GPUs together, on
    one node, before the actor starts, and hands them back when the attempt ends.
    """
    return [{"GPU": float(ranks), "CPU": float(cpus)}]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
