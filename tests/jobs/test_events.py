"""The job event contract: only declared events, fields and error codes can be produced or read back."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import ValidationError

from jobs import JobSpecError, OutOfMemoryHint, SpecProblem
from jobs.events import (
    EVENT_TYPES,
    JOB_EVENTS,
    ErrorCode,
    FailedEvent,
    JobEvent,
    SampleEvent,
    StepEvent,
    error_code_for,
    event_to_wire,
    failed_event,
    parse_job_event,
)
from offload import OffloadStats

STEP = {"step": 1, "total_steps": 2, "loss": 0.5, "lr": 1e-3, "samples_per_s": 4.0, "elapsed_s": 0.1, "eta_s": 0.1}


def test_the_contract_declares_the_issue_s_event_types() -> None:
    assert set(EVENT_TYPES) == {
        *("started", "step", "eval", "checkpoint", "sample", "log", "finished", "failed"),
        "cache_progress",  # task: cache jobs (diffusion split training)
        "export",  # the spec's export: section, after a successful job
    }
    assert [EVENT_TYPES[cls.model_fields["type"].default] for cls in JOB_EVENTS] == list(JOB_EVENTS)


def test_every_event_round_trips_through_its_wire_form() -> None:
    events = [
        StepEvent(**STEP, offload=OffloadStats(h2d_bytes=10)),
        SampleEvent(step=3, prompt="a cat", artifact_path="samples/3.png", media_type="image/png"),
        failed_event(OutOfMemoryHint("device out of memory")),
    ]
    for event in events:
        assert parse_job_event(event_to_wire(event)) == event


def test_an_undeclared_event_type_cannot_be_produced_or_read() -> None:
    class ProgressEvent(JobEvent):
        type: Literal["progress"] = "progress"

    with pytest.raises(TypeError, match="not a declared job event"):
        event_to_wire(ProgressEvent())
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        parse_job_event({"type": "progress"})


def test_an_undeclared_field_is_refused() -> None:
    with pytest.raises(ValidationError, match="gpu_util\n  Extra inputs are not permitted"):
        StepEvent(**STEP, gpu_util=0.9)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        parse_job_event({"type": "step", **STEP, "gpu_util": 0.9})


def test_an_undeclared_error_code_is_refused() -> None:
    with pytest.raises(ValidationError, match="Input should be 'out_of_memory', 'invalid_spec'"):
        parse_job_event({"type": "failed", "error": "OutOfMemoryHint", "message": "m"})
    with pytest.raises(ValidationError):
        FailedEvent(error="ValueError", message="m")  # type: ignore[arg-type]


def test_exceptions_map_to_their_codes() -> None:
    assert error_code_for(OutOfMemoryHint("x")) is ErrorCode.OUT_OF_MEMORY
    assert error_code_for(JobSpecError([SpecProblem("name", "bad")])) is ErrorCode.INVALID_SPEC
    assert error_code_for(ValueError("x")) is ErrorCode.TRAINING_ERROR
    assert event_to_wire(failed_event(KeyError("k"))) == {
        "type": "failed",
        "error": "training_error",
        "message": "'k'",
        "exception": "KeyError",
    }


def test_codes_stored_before_the_contract_read_as_declared_ones() -> None:
    assert ErrorCode.from_stored("OutOfMemoryHint") is ErrorCode.OUT_OF_MEMORY
    assert ErrorCode.from_stored("ValueError") is ErrorCode.TRAINING_ERROR
    assert ErrorCode.from_stored("interrupted") is ErrorCode.INTERRUPTED


def test_a_sample_carries_text_or_an_artifact() -> None:
    assert SampleEvent(step=1, prompt="Hi", text="Hello").text == "Hello"
    with pytest.raises(ValidationError, match="a sample event carries text or an artifact_path"):
        SampleEvent(step=1, prompt="Hi")
