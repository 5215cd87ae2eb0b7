"""Typo hints: a value or key that differs only in case is suggested as itself, not as a near neighbour."""

from __future__ import annotations

import pytest

from jobs.errors import JobSpecError
from jobs.spec.loading import load_job_spec

SPEC = """name: x
model: {kind: toy_mlp}
data: {kind: synthetic_regression}
training: {steps: 1, optimizer: OPTIMIZER}
device: cpu
"""


@pytest.mark.parametrize(("given", "suggested"), [("adamW", "adamw"), ("ADAM", "adam"), ("SGD", "sgd")])
def test_the_optimizer_hint_matches_case_first(given: str, suggested: str) -> None:
    with pytest.raises(JobSpecError) as caught:
        load_job_spec(SPEC.replace("OPTIMIZER", given))
    [problem] = caught.value.problems
    assert (problem.path, problem.line, problem.suggestion) == ("training.optimizer", 4, suggested)
    assert str(problem) == (
        f"training.optimizer (line 4): must be one of adamw, adam, sgd; got '{given}'; did you mean '{suggested}'?"
    )


def test_a_key_in_the_wrong_case_suggests_itself() -> None:
    with pytest.raises(JobSpecError) as caught:
        load_job_spec(SPEC.replace("optimizer: OPTIMIZER", "Learning_Rate: 0.1"))
    assert caught.value.problems[0].suggestion == "learning_rate"
