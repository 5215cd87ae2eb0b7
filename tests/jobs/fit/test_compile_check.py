"""``training.compile`` over the offload engine is refused where the job would run on CUDA: on an H100 (commit
f02ebe7) that path gave NaN losses and an illegal memory access (jobs/fit/checks.py). Refused at submit by the
service and by ``python -m jobs validate``'s machine checks (jobs/cli.py), and at job start; nothing stored; the CPU path and compile without model
offload are left as they are."""

from __future__ import annotations

import pytest

from jobs import JobSpec
from jobs.fit.checks import UNSAFE_COMPILE_SWITCH, compile_problem
from service.checking.fit import refuse_compile_over_offload_on_a_gpu
from service.errors import ApiError
from service.workers.devices import Slot
from tests.jobs.helpers import TOY, merged, spec_from


def spec(device: str = "auto") -> JobSpec:
    return spec_from(
        merged(
            TOY,
            training={"compile": True},
            offload={"enable_model_cpu_offload": True, "granularity": "block"},
            device=device,
        )
    )


def test_compile_over_offload_is_refused_where_the_job_runs_on_cuda() -> None:
    for device, has_gpu in (("auto", True), ("cuda", True)):
        problem = compile_problem(spec(device), has_gpu=has_gpu)
        assert problem is not None and problem[0] == "training.compile"
        assert "set training.compile: false" in problem[1] and "NaN" in problem[1]


def test_the_cpu_and_compile_without_offload_are_left_alone() -> None:
    assert compile_problem(spec("auto"), has_gpu=False) is None
    assert compile_problem(spec("cpu"), has_gpu=True) is None
    no_offload = spec_from(merged(TOY, training={"compile": True}, device="auto"))
    assert compile_problem(no_offload, has_gpu=True) is None


def test_the_developer_switch_lets_it_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UNSAFE_COMPILE_SWITCH, "1")
    assert compile_problem(spec("cuda"), has_gpu=True) is None


def test_the_service_refuses_it_with_the_path_and_line_on_a_gpu_worker() -> None:
    text = "training:\n  compile: true\n"
    with pytest.raises(ApiError) as refused:
        refuse_compile_over_offload_on_a_gpu(spec("auto"), [Slot("gpu0", "cuda:0"), Slot("cpu0", None)], text)
    assert (refused.value.status_code, refused.value.code) == (422, "unsupported")
    problem = refused.value.problems[0]
    assert problem["path"] == "training.compile" and problem["line"] == 2
    refuse_compile_over_offload_on_a_gpu(spec("auto"), [Slot("cpu0", None)], text)  # a CPU-only service runs it
