"""Jobs of several GPUs (``distributed.world_size``) with the stand-in executor on two simulated GPUs: a
2-GPU job waits for both, a 1-GPU job behind it uses a GPU that would idle, and neither starves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.workers.devices import Slot
from service.workers.placement import ranks_of
from tests.service.workers.test_scheduler import end, make

GPUS = [Slot("gpu0", "0"), Slot("gpu1", "1")]
DONE = {"type": "finished", "status": "succeeded", "step": 1}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    store = JobStore(tmp_path / "ferry.sqlite3")
    yield store
    store.close()


def add(store: JobStore, job_id: str, ranks: int = 1) -> str:
    text = f"name: {job_id}\ndistributed: {{world_size: {ranks}}}\n" if ranks > 1 else f"name: {job_id}\n"
    store.create_job(job_id=job_id, name=job_id, spec_text=text, spec={})
    return job_id


def launched(executor: object) -> list[tuple[str, str | None]]:
    return [(h.request.job_id, h.request.device) for h in executor.launched]  # type: ignore[attr-defined]


def test_a_two_gpu_job_waits_for_both_and_a_one_gpu_job_behind_it_is_not_starved(
    store: JobStore, tmp_path: Path
) -> None:
    scheduler, executor = make(store, tmp_path, GPUS)
    add(store, "a")  # one GPU, running when the wide job arrives
    scheduler.tick()
    add(store, "wide", ranks=2)
    add(store, "b")  # behind the wide job: gpu1 is free, and the wide job cannot use it alone
    scheduler.tick()
    assert launched(executor) == [("a", "0"), ("b", "1")]
    assert store.get_job("wide").status is JobStatus.QUEUED

    add(store, "c")  # also behind it: a freed GPU is kept for the wide job, not given to c
    end(store, executor.launched[0], 0, **DONE)
    scheduler.tick()
    assert launched(executor) == [("a", "0"), ("b", "1")]
    assert scheduler.running.keys() == {"gpu1"}

    end(store, executor.launched[1], 0, **DONE)
    scheduler.tick()
    assert launched(executor)[2] == ("wide", "0,1")
    wide = store.get_job("wide")
    assert (wide.status, wide.worker, wide.device) == (JobStatus.RUNNING, "gpu0+gpu1", "0,1")
    assert scheduler.running["gpu0"] is scheduler.running["gpu1"]
    assert store.get_job("c").status is JobStatus.QUEUED

    end(store, executor.launched[2], 0, **DONE)  # one process for both GPUs: settled once, both freed
    scheduler.tick()
    assert store.get_job("wide").status is JobStatus.SUCCEEDED
    assert launched(executor)[3:] == [("c", "0")]
    assert [e.data["status"] for e in store.list_events("wide") if e.type == "status"].count("succeeded") == 1


def test_a_cancel_reaches_the_one_process_of_a_wide_job(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, GPUS)
    add(store, "wide", ranks=2)
    scheduler.tick()
    store.cancel("wide")
    scheduler.tick()
    assert executor.launched[0].stops == ["cancel"]
    scheduler.tick()  # cancel_grace_s=0: killed on the next tick
    assert store.get_job("wide").status is JobStatus.CANCELLED
    assert scheduler.running == {}


def test_a_job_wider_than_the_host_fails_instead_of_waiting_for_ever(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, GPUS)
    add(store, "huge", ranks=4)
    add(store, "small")
    scheduler.tick()
    huge = store.get_job("huge")
    assert huge.status is JobStatus.FAILED and huge.error_code == "launch_failed"
    assert huge.error_message == "distributed.world_size=4 needs 4 GPUs of one host; this service has 2"
    assert launched(executor) == [("small", "0")]


def test_ranks_on_cpu_slots_share_one_slot(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, [Slot("cpu0", None)])
    add(store, "wide", ranks=2)
    scheduler.tick()
    assert launched(executor) == [("wide", None)]
    assert store.get_job("wide").worker == "cpu0"


def test_a_lost_rank_is_an_interrupted_attempt(store: JobStore, tmp_path: Path) -> None:
    scheduler, executor = make(store, tmp_path, GPUS)
    add(store, "wide", ranks=2)
    scheduler.tick()
    lost = "a rank of 2 ended without finishing: rank 1 (signal SIGKILL)"
    end(store, executor.launched[0], 1, type="failed", error="interrupted", message=lost, exception="RankLost")
    scheduler.tick()
    job = store.get_job("wide")
    assert (job.status, job.retries, job.attempt) == (JobStatus.RUNNING, 1, 2)  # requeued and started again
    assert lost in [e.data["reason"] for e in store.list_events("wide") if e.type == "status"]


def test_ranks_of_reads_the_spec(store: JobStore) -> None:
    assert ranks_of(store.get_job(add(store, "wide", ranks=3))) == 3
    assert ranks_of(store.get_job(add(store, "narrow"))) == 1
