"""``FERRY_HOST_MEMORY_BUDGET``: host memory the jobs of one server share. A job that sets no
``offload.host_memory_limit`` gets the budget over the worker slots, at submit (the fit check plans and refuses
with it) and in its worker (the child process sets it on the spec)."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from jobs import PathRoots
from jobs.fit.disk_tier import with_host_memory_limit
from service.checking.check import check_spec
from service.checking.messages import CheckRequest
from service.settings import Settings
from tests.jobs.helpers import spec_from, write_corpus
from tests.jobs.train.test_disk_tier import lm_job, write_weights


def test_the_budget_is_shared_between_the_worker_slots(tmp_path: Path) -> None:
    assert Settings(data_dir=tmp_path, host_memory_budget="1GiB").host_memory_share(4) == 256 << 20
    assert Settings(data_dir=tmp_path).host_memory_share(4) is None
    with pytest.raises(pydantic.ValidationError, match="FERRY_HOST_MEMORY_BUDGET"):
        Settings(data_dir=tmp_path, host_memory_budget="lots")


def test_a_job_without_a_limit_is_checked_and_run_with_the_servers_share(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    write_corpus(tmp_path / "data" / "corpus")
    roots = PathRoots(model_roots=[tmp_path / "models"], data_roots=[tmp_path / "data"])
    data = lm_job()
    write_weights(data, roots)
    text = yaml.safe_dump(data)

    def checked(share: int | None) -> object:
        return check_spec(
            CheckRequest(
                text=text,
                model_roots=(str(tmp_path / "models"),),
                data_roots=(str(tmp_path / "data"),),
                max_yaml_depth=32,
                max_yaml_nodes=20_000,
                host_memory_limit=share,
            )
        )

    assert checked(None).refusal is None  # type: ignore[attr-defined]
    refusal = checked(64 << 10).refusal  # type: ignore[attr-defined]
    assert refusal is not None and refusal.code == "does_not_fit"
    assert "offload.host_memory_limit is 64.0 KiB" in refusal.message
    spec = spec_from(data, roots)
    assert with_host_memory_limit(spec, 1 << 30).offload.host_memory_limit == 1 << 30
    own = spec_from({**data, "offload": {**data["offload"], "host_memory_limit": "2GiB"}}, roots)
    assert with_host_memory_limit(own, 1 << 30).offload.host_memory_limit == "2GiB"  # the job's own wins


def test_the_worker_hands_its_share_to_a_job_that_sets_no_limit(tmp_path: Path) -> None:
    from jobs.events import event_to_wire
    from service.workers.executor.base import LaunchRequest
    from service.workers.executor.child import _run

    (tmp_path / "models").mkdir()
    write_corpus(tmp_path / "data" / "corpus")
    roots = PathRoots(model_roots=[tmp_path / "models"], data_roots=[tmp_path / "data"])
    data = {**lm_job(steps=2), "checkpoint": {"save_final": False}}
    write_weights(data, roots)
    share = spec_from(data, roots)
    from jobs import estimate_memory

    limit = estimate_memory(share).pinned_host_bytes // 2
    request = LaunchRequest(job_id="j", attempt=1, spec_text=yaml.safe_dump(data), output_dir=tmp_path / "out",
                            device=None, db_path=tmp_path / "db", log_path=tmp_path / "log",
                            model_roots=roots.model_roots, data_roots=roots.data_roots,
                            host_memory_limit=limit)  # fmt: skip
    events: list[dict] = []
    _run(request, lambda event: events.append(event_to_wire(event)), lambda: None)
    said = [e["message"] for e in events if e["type"] == "log" and "host_memory_limit" in e["message"]]
    assert said and f"offload.host_memory_limit {limit}:" in said[0]
    assert [e for e in events if e["type"] == "step"][-1]["offload"]["disk_read_bytes"] > 0
