"""Errors that `jobs` raises for a user to read: a refused spec (its problems), an out-of-memory hint and a
full disk."""

from __future__ import annotations

from dataclasses import dataclass

Problem = tuple[str, str]
"""What a spec rule returns for each violation: (dotted path in the job spec, message). `load_job_spec` adds the
YAML line and reports it as a `SpecProblem`."""


@dataclass(frozen=True)
class SpecProblem:
    """One problem in a job spec.

    Attributes:
        path: Dotted path of the offending field, e.g. ``training.learning_rate`` ("" for the whole file).
        message: What is wrong and how to fix it.
        line: 1-based line in the YAML text, when known.
        suggestion: The closest valid key or value for a typo, when there is one.
    """

    path: str
    message: str
    line: int | None = None
    suggestion: str | None = None

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line is not None else ""
        hint = f"; did you mean '{self.suggestion}'?" if self.suggestion else ""
        return f"{self.path or '<spec>'}{where}: {self.message}{hint}"


class JobSpecError(ValueError):
    """A job spec was refused. ``problems`` lists every problem found, not just the first."""

    def __init__(self, problems: list[SpecProblem]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid job spec ({len(self.problems)} problem(s)):\n{lines}")


class DiskFullError(OSError):
    """The disk filled while the job wrote to it; the message names the directory and what frees room."""


class OutOfMemoryHint(RuntimeError):
    """The device ran out of memory; the message names the offload setting that would help."""


class RankLost(RuntimeError):
    """A rank of a data-parallel job ended without finishing (killed, crashed, or another rank failed): the
    attempt is interrupted and the job resumes from its last checkpoint."""
