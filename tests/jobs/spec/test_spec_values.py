"""Values pydantic's lax mode would take but no run can use: refused with their path and line, all at once."""

from __future__ import annotations

import json

import pytest

from jobs import JobSpecError, load_job_spec

SPEC = (
    "name: bounds\n"
    "model: {kind: toy_mlp, hidden_size: 8, num_layers: 1}\n"
    "data: {kind: synthetic_regression%s}\n"
    "training: {steps: 5%s}\n"
    "device: %s\n"
)


def problems(data: str = "", training: str = "", device: str = "cpu") -> dict[str, tuple[int | None, str, str | None]]:
    with pytest.raises(JobSpecError) as caught:
        load_job_spec(SPEC % (data, training, device))
    return {p.path: (p.line, p.message, p.suggestion) for p in caught.value.problems}


@pytest.mark.parametrize(
    ("data", "training"),
    [
        ("", ", learning_rate: .inf"),
        ("", ", learning_rate: 1e400"),
        ("", ", learning_rate: Infinity"),
        (", offset: .nan", ""),
    ],
)
def test_floats_must_be_finite(data: str, training: str) -> None:
    found = problems(data, training)
    path = "data.offset" if data else "training.learning_rate"
    assert [(line, message.split(";")[0]) for line, message, _ in found.values()] == [
        (3 if data else 4, "must be a finite number")
    ]
    assert list(found) == [path]


def test_json_infinity_is_refused() -> None:
    body = {"name": "j", "model": {"kind": "toy_mlp"}, "data": {"kind": "synthetic_regression"}}
    text = json.dumps({**body, "training": {"steps": 1, "learning_rate": float("inf")}})  # writes Infinity
    with pytest.raises(JobSpecError, match="training.learning_rate.*finite number"):
        load_job_spec(text)


def test_booleans_are_not_numbers_and_ints_fit_int64_every_problem_at_once() -> None:
    found = problems(training=", steps: true, seed: 18446744073709551616, batch_size: 1000000000000")
    assert found == {
        "training.steps": (4, "must be a number, not true", None),
        "training.seed": (4, "must be within ±(2**63 - 1), what the store holds; got a 65-bit number", None),
        "training.batch_size": (4, "must be at most 1048576; got 1000000000000", None),
    }


def test_steps_beyond_int64_and_run_bounds() -> None:
    assert problems(training=", steps: 9223372036854775808") == {
        "training.steps": (4, "must be within ±(2**63 - 1), what the store holds; got a 64-bit number", None)
    }
    assert problems(training=", steps: 9223372036854775807")["training.steps"][1] == (
        "must be at most 1000000000; got 9223372036854775807"
    )


def test_a_huge_integer_is_a_problem_not_a_crash() -> None:
    found = problems(training=", seed: " + "9" * 5000)
    # The YAML guard refuses it before any field reads it (jobs/spec/yaml_guard.py), naming the size.
    assert list(found) == [""] and found[""][1].startswith("a number of 5000 digits; no field takes more than")


def test_booleans_stay_valid_where_a_field_takes_them() -> None:
    spec = load_job_spec(SPEC % ("", "", "cpu\noffload: {enable_model_cpu_offload: true}"))
    assert spec.offload.enable_model_cpu_offload is True


@pytest.mark.parametrize(
    ("training", "device", "path", "message", "suggestion"),
    [
        ("", "gpu", "device", "must be one of auto, cuda, cpu; got 'gpu'", "cuda"),
        (", optimizer: adam_w", "cpu", "training.optimizer", "must be one of adamw, adam, sgd; got 'adam_w'", "adamw"),
    ],
)
def test_enum_typos_get_a_suggestion(training: str, device: str, path: str, message: str, suggestion: str) -> None:
    assert problems(training=training, device=device)[path][1:] == (message, suggestion)


def test_a_bad_name_is_explained_without_a_regex() -> None:
    with pytest.raises(JobSpecError) as caught:
        load_job_spec((SPEC % ("", "", "cpu")).replace("name: bounds", "name: my job"))
    assert [(p.path, p.message) for p in caught.value.problems] == [
        ("name", "must start with a letter or digit and hold only letters, digits, '.', '_' and '-'; got 'my job'")
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"cu\\ud800da"', "holds a lone surrogate (\\ud800) at character 3; send valid Unicode text"),
        ('"cp\\x07u"', "holds the control character \\x07 at character 3; remove it"),
    ],
)
def test_lone_surrogates_and_control_characters_are_refused(value: str, message: str) -> None:
    assert problems(device=value) == {"device": (5, message, None)}


def test_a_key_with_a_surrogate_is_shown_escaped() -> None:
    found = problems(training=', "x\\udc00": 1')
    assert found == {
        "training.x\\udc00": (4, "key holds a lone surrogate (\\udc00) at character 2; send valid Unicode text", None)
    }
