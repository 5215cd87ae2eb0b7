"""Pydantic's errors in Ferry's words: each names the rule, what was given and the fix, at its field and line."""

from __future__ import annotations

import pytest

from jobs import JobSpecError, load_job_spec

SPEC = """\
name: wording
model:
  kind: toy_mlp
  hidden_size: 8
  num_layers: 1
data:
  kind: synthetic_regression
training:
  steps: 5
  learning_rate: 0.01
offload:
  enable_model_cpu_offload: false
"""


@pytest.mark.parametrize(
    ("old", "new", "path", "line", "message"),
    [
        ("steps: 5", "steps: 1e3", "training.steps", 9, "must be a whole number; got 1e3 (write 1000)"),
        ("steps: 5", "steps: 2.5", "training.steps", 9, "must be a whole number; got 2.5 (round it)"),
        ("steps: 5", "steps: five", "training.steps", 9, "must be a whole number; got 'five'"),
        ("steps: 5", "steps: [5]", "training.steps", 9, "must be a whole number; got a list"),
        ("steps: 5", "steps: 0", "training.steps", 9, "must be greater than 0; got 0"),
        (
            "learning_rate: 0.01",
            "learning_rate: fast",
            "training.learning_rate",
            10,
            "must be a number (like 0.001 or 1.0e-3); got 'fast'",
        ),
        (
            "learning_rate: 0.01",
            "learning_rate: .inf",
            "training.learning_rate",
            10,
            "must be a finite number; got inf",
        ),
        (
            "enable_model_cpu_offload: false",
            "enable_model_cpu_offload: maybe",
            "offload.enable_model_cpu_offload",
            12,
            "must be true or false; got 'maybe'",
        ),
        ("name: wording", "name: [a, b]", "name", 1, "must be a string; got a list"),
        ("name: wording", "name: 7", "name", 1, "must be a string; got 7 (quote it)"),
        (
            "  kind: toy_mlp\n",
            "",
            "model",
            2,
            "needs a 'kind:' key naming which one it is; add it (python -m jobs schema lists the kinds)",
        ),
        (
            "data:\n  kind: synthetic_regression\n",
            "data: [1]\n",
            "data",
            6,
            "must be a section (indented keys under it); got a list",
        ),
    ],
)
def test_pydantic_errors_are_said_in_ferrys_words(old: str, new: str, path: str, line: int, message: str) -> None:
    text = SPEC.replace(old, new, 1)
    assert text != SPEC
    with pytest.raises(JobSpecError) as caught:
        load_job_spec(text)
    assert [(p.path, p.line, p.message) for p in caught.value.problems] == [(path, line, message)]
    assert "Input should" not in str(caught.value)
