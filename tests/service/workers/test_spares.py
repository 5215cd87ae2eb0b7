"""Spare job processes (service/workers/executor/spares.py): a warm job runs in the spare that did its imports before
the job was claimed, a spare that dies is replaced, and no spare outlives its server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from service.queue.records import JobRecord
from service.queue.store import JobStore
from service.workers.executor import LaunchRequest, LocalProcessExecutor
from service.workers.executor.child import SPARE_NAME
from service.workers.executor.local import LocalProcessHandle
from service.workers.executor.spares import Spare
from tests.service.conftest import REPO, Server, spec_yaml, submit, wait_status

CPU = (None, 1)  # a CPU slot's key: (device, cpu_threads)
DEADLINE_S = 120.0  # a spare's imports take seconds; far more on a loaded machine
SLOW_TORCH_PARTS = ("torch.utils.tensorboard", "torch._dynamo", "torch._inductor", "torch.optim")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    store = JobStore(tmp_path / "ferry.sqlite3")
    yield store
    store.close()


@pytest.fixture
def executor() -> Iterator[LocalProcessExecutor]:
    executor = LocalProcessExecutor(warm=[CPU])
    yield executor
    executor.close()


def ready_spare(executor: LocalProcessExecutor, unlike: int | None = None) -> Spare:
    """Tick the executor as the scheduler does until its spare (not pid ``unlike``) has done its imports."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        executor.keep_warm()
        ready = [s for s in executor.spares() if s.ready_at is not None and s.pid != unlike]
        if ready:
            return ready[0]
        time.sleep(0.05)
    raise TimeoutError(f"no spare became ready: {executor.spares()}")


def launch_and_wait(
    store: JobStore, executor: LocalProcessExecutor, tmp_path: Path, job: JobRecord, *, timeout_message: str
) -> LocalProcessHandle:
    """Launch ``job``'s attempt (a CPU job, its output and log under ``tmp_path / job.id``) and wait for its
    process to exit."""
    request = LaunchRequest(
        job_id=job.id, attempt=job.attempt, spec_text=job.spec_text, output_dir=tmp_path / job.id / "output",
        device=None, db_path=store.db.path, log_path=tmp_path / job.id / "job.log", cpu_threads=1,
    )  # fmt: skip
    handle = executor.launch(request)
    deadline = time.monotonic() + DEADLINE_S
    while handle.exit_code() is None:
        assert time.monotonic() < deadline, timeout_message
        time.sleep(0.05)
    return handle


def claim_and_launch(store: JobStore, executor: LocalProcessExecutor, tmp_path: Path, job_id: str) -> tuple:
    store.create_job(job_id=job_id, name=job_id, spec_text=spec_yaml(job_id, steps=3, every=3), spec={})
    job = store.claim_next(worker="cpu0", device=None)
    claimed_at = time.time()
    handle = launch_and_wait(store, executor, tmp_path, job, timeout_message="the job did not end")
    return handle, claimed_at, (tmp_path / job_id / "job.log").read_text()


def test_a_warm_job_runs_in_the_spare_whose_imports_finished_before_the_claim(
    store: JobStore, executor: LocalProcessExecutor, tmp_path: Path
) -> None:
    spare = ready_spare(executor)
    handle, claimed_at, log = claim_and_launch(store, executor, tmp_path, "warm")

    assert handle.exit_code() == 0, log[-2000:]
    assert handle.pid == spare.pid and handle.warm
    assert store.last_outcome("warm", 1).status == "succeeded"
    # The job's own process says it was the spare and when the spare's imports finished: before the claim.
    (pid, imported_at), *_ = re.findall(r"starting in pid (\d+) .*its imports finished at ([\d.]+)", log)
    assert int(pid) == spare.pid and float(imported_at) < claimed_at


IMPORTS_AFTER_THE_SPARES = """
import sys, tempfile
from pathlib import Path
from service.workers.executor.base import LaunchRequest
from service.workers.executor.child import _import_what_a_job_needs, _prepare_process, run_attempt

_prepare_process(None, 1)
_import_what_a_job_needs()
before = set(sys.modules)
out = Path(tempfile.mkdtemp())
class Sink:
    def append_events(self, job_id, attempt, events): pass
text = Path("configs/cpu_smoke.yaml").read_text()
request = LaunchRequest(job_id="j", attempt=1, spec_text=text, output_dir=out, device=None,
                        db_path=out / "db", log_path=out / "job.log", cpu_threads=1)
assert run_attempt(request, Sink(), lambda: None) == 0
print(" ".join(sorted(set(sys.modules) - before)))
"""


def test_a_spare_imports_everything_the_smoke_job_needs_before_its_job_arrives() -> None:
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_AFTER_THE_SPARES], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = done.stdout.split()
    # Only torch's and numpy's own small lazy modules are left to the job: nothing of Ferry's packages
    # (jobs, offload, service), TensorBoard or torch's compiler stack.
    heavy = [m for m in imported if m.split(".")[0] not in ("torch", "numpy") or m.startswith(SLOW_TORCH_PARTS)]
    assert heavy == [], heavy


def test_a_job_handed_to_a_spare_still_importing_runs_there_once_it_is_done(
    store: JobStore, executor: LocalProcessExecutor, tmp_path: Path
) -> None:
    (importing,) = executor.spares()  # just spawned: its imports take seconds
    handle, _, log = claim_and_launch(store, executor, tmp_path, "early")
    assert handle.exit_code() == 0 and handle.pid == importing.pid and not handle.warm, log[-2000:]
    assert "(a spare process that was still importing when the job arrived)" in log
    assert store.last_outcome("early", 1).status == "succeeded"


def test_the_slots_next_spare_is_started_after_a_hand_over(
    store: JobStore, executor: LocalProcessExecutor, tmp_path: Path
) -> None:
    first = ready_spare(executor)
    claim_and_launch(store, executor, tmp_path, "one")
    second = ready_spare(executor, unlike=first.pid)
    handle, _, log = claim_and_launch(store, executor, tmp_path, "two")
    assert handle.pid == second.pid != first.pid and handle.warm, log[-2000:]


def test_a_spare_that_dies_is_replaced_and_the_job_goes_to_its_successor(
    store: JobStore, executor: LocalProcessExecutor, tmp_path: Path
) -> None:
    dead = ready_spare(executor)
    os.kill(dead.pid, signal.SIGKILL)  # the OOM killer, say, while it waits for a job
    successor = ready_spare(executor, unlike=dead.pid)
    assert not psutil.pid_exists(dead.pid) or psutil.Process(dead.pid).status() == psutil.STATUS_ZOMBIE
    handle, _, log = claim_and_launch(store, executor, tmp_path, "after-death")
    assert handle.exit_code() == 0 and handle.pid == successor.pid and handle.warm, log[-2000:]


def test_without_a_spare_a_job_still_starts_in_a_fresh_process(store: JobStore, tmp_path: Path) -> None:
    cold = LocalProcessExecutor(warm=[])
    try:
        handle, _, log = claim_and_launch(store, cold, tmp_path, "cold")
    finally:
        cold.close()
    assert handle.exit_code() == 0 and not handle.warm and "(a fresh process)" in log, log[-2000:]


def children_of(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def all_gone(processes: list[psutil.Process], timeout: float) -> bool:
    """True once none of ``processes`` runs (a zombie no one has reaped yet counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for process in processes:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def wait_for_spares(server: Server, count: int) -> list[psutil.Process]:
    """The server's spare processes (named so by the spare itself), once there are ``count``."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        spares = [p for p in children_of(server.process.pid) if p.name() == SPARE_NAME]
        if len(spares) >= count:
            return spares
        time.sleep(0.1)
    raise TimeoutError("the server started no spare")


def test_no_spare_outlives_a_stopped_or_killed_server(make_server: Callable[..., Server]) -> None:
    first = make_server(FERRY_CPU_WORKERS="2")
    wait_for_spares(first, 2)
    children = children_of(first.process.pid)
    first.stop()
    assert all_gone(children, timeout=10), [p.pid for p in children]

    # A crash while the spares wait: a new server starts at once (no spare holds the data directory's
    # lock), the old spares leave by themselves, and the new server's jobs run in its own warm spares.
    second = make_server(data_dir=first.data_dir)
    spares = wait_for_spares(second, 1)
    children = children_of(second.process.pid)
    second.kill()
    third = make_server(data_dir=first.data_dir)
    assert all_gone(children, timeout=DEADLINE_S), [p.pid for p in children]
    new_spares = wait_for_spares(third, 1)
    with third.client() as client:
        job = submit(client, spec_yaml("after-crash", steps=3, every=3))
        ended = wait_status(client, job["id"], "succeeded", "failed")
        assert ended["status"] == "succeeded", ended["error"]
        log = client.get(f"/v1/jobs/{job['id']}/logs").text
    pid = int(re.findall(r"starting in pid (\d+)", log)[0])
    assert pid in {p.pid for p in new_spares} and pid not in {p.pid for p in spares}


def test_a_job_process_records_its_own_pid_before_it_runs(
    store: JobStore, executor: LocalProcessExecutor, tmp_path: Path
) -> None:
    # No scheduler here, so nobody else calls set_process: a server that died right after the hand-over
    # would leave the same gap, and a restarted server would not know which process to wait for.
    handle, _, log = claim_and_launch(store, executor, tmp_path, "self-recorded")
    job = store.get_job("self-recorded")
    assert handle.exit_code() == 0 and (job.pid, job.pid_started_at) == (handle.pid, handle.started_at), log[-2000:]


def test_a_job_taken_back_before_its_process_starts_is_not_run(
    store: JobStore, executor: LocalProcessExecutor, tmp_path: Path
) -> None:
    from service.queue.status import JobStatus

    spare = ready_spare(executor)
    store.create_job(job_id="taken", name="taken", spec_text=spec_yaml("taken", steps=3, every=3), spec={})
    job = store.claim_next(worker="cpu0", device=None)
    # A restarted server's recovery got there first: it interrupted attempt 1 and queued the job again.
    store.transition(job.id, JobStatus.INTERRUPTED, reason="the test's recovery")
    store.requeue_interrupted(job.id, max_retries=3)
    handle = launch_and_wait(store, executor, tmp_path, job, timeout_message="the process did not leave")
    assert handle.pid == spare.pid and handle.exit_code() == 0
    assert "was taken back before it started" in (tmp_path / "taken" / "job.log").read_text()
    after = store.get_job(job.id)
    assert after.status is JobStatus.QUEUED and after.pid is None
    assert [e.type for e in store.list_events(job.id, limit=100) if e.attempt == 1 and e.type != "status"] == []
    assert not (tmp_path / "taken" / "output").exists()


PREPARED_ALLOCATOR = """
import os, sys
from service.workers.executor.child import _prepare_process
_prepare_process(sys.argv[1] or None, None if sys.argv[1] else 1)
print(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "unset"))
"""


@pytest.mark.parametrize(
    ("device", "users", "expected"),
    [
        ("0", None, "expandable_segments:True"),  # a GPU job: reserved memory tracks allocated memory
        ("0", "max_split_size_mb:128", "max_split_size_mb:128"),  # the user's own setting is kept
        ("", None, "unset"),  # a CPU job has no CUDA allocator to configure
    ],
)
def test_a_gpu_jobs_process_uses_expandable_segments_unless_the_user_chose(
    device: str, users: str | None, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if users is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = users
    done = subprocess.run(
        [sys.executable, "-c", PREPARED_ALLOCATOR, device],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == expected
