"""``Graders``: the rewards of sampled completions under one grader spec (jobs/spec/graders.py).

A grader that raises, times out or returns something that is not a finite number gives reward 0 for that
completion, and each distinct error is logged once (``take_new_errors`` hands them to the job's events too): a
bad grader never crashes the job.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobs.objectives.graders.math_answer import math_answer
from jobs.objectives.graders.sandbox import run_python_grader
from jobs.objectives.graders.templates import render, sample_of
from jobs.objectives.graders.text import string_check, text_similarity
from jobs.spec.formula import evaluate_formula

log = logging.getLogger(__name__)

_ONE: dict[str, Callable[[Any, str, dict[str, Any]], float]] = {
    "string_check": string_check,
    "text_similarity": text_similarity,
    "math_answer": math_answer,
}


class Graders:
    """Rewards of completions under one grader spec.

    Example:
        >>> grade = Graders(GRPOSpec.model_validate({"grader": {"type": "string_check", "reference": "{{item.answer}}"}}).grader)
        >>> grade(["4", "5"], [{"answer": "4"}, {"answer": "4"}])
        [1.0, 0.0]
    """

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self._logged: set[str] = set()
        self._new: list[str] = []
        self._sources: dict[int, Path] = {}  # a python grader's source, written once to a folder of its own
        self._folders: list[tempfile.TemporaryDirectory[str]] = []
        self._judges: dict[int, Any] = {}  # a score_model grader's loaded model, by the spec's id
        self._embedders: dict[int, Any] = {}  # a cosine text_similarity grader's encoder, by the spec's id

    def __call__(self, completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        """One finite reward per completion (0 where its grader failed)."""
        return self._grade(self.spec, completions, rows)

    def _grade(self, spec: Any, completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        if spec.type == "multi":
            return self._multi(spec, completions, rows)
        if spec.type == "python":
            samples = [sample_of(completion) for completion in completions]
            values = run_python_grader(spec, self._python_file(spec), samples, rows)
            return [self._finite(spec, value) for value in values]
        if spec.type == "score_model":
            return [self._finite(spec, value) for value in self._judge(spec).score(completions, rows)]
        if spec.type == "text_similarity" and spec.evaluation_metric == "cosine":
            return self._cosine(spec, completions, rows)
        one = _ONE[spec.type]
        rewards = []
        for completion, row in zip(completions, rows, strict=True):
            try:
                value: Any = one(spec, completion, row)
            except Exception as error:
                value = error
            rewards.append(self._finite(spec, value))
        return rewards

    def _multi(self, spec: Any, completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        each = {grader.name: self._grade(grader, completions, rows) for grader in spec.graders}
        if spec.calculate_output is None:
            return [
                sum(spec.weights.get(name, 1.0) * rewards[index] for name, rewards in each.items())
                for index in range(len(completions))
            ]
        combined = []
        for index in range(len(completions)):
            try:
                value: Any = evaluate_formula(spec.calculate_output, {n: r[index] for n, r in each.items()})
            except (ArithmeticError, ValueError) as error:  # log(0), sqrt(-1), a division by 0
                value = error
            combined.append(self._finite(spec, value))
        return combined

    def _cosine(self, spec: Any, completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        try:
            pairs = [
                (render(spec.input, c, r), render(spec.reference, c, r)) for c, r in zip(completions, rows, strict=True)
            ]
            if id(spec) not in self._embedders:
                from jobs.objectives.graders.embeddings import Embedder

                self._embedders[id(spec)] = Embedder(spec.embedding_model)
            scores: list[Any] = self._embedders[id(spec)].cosine([g for g, _ in pairs], [r for _, r in pairs])
        except Exception as error:  # a missing column, an encoder that does not load: the whole batch scores 0
            scores = [error] * len(completions)
        return [self._finite(spec, value) for value in scores]

    def _python_file(self, spec: Any) -> Path:
        if spec.file is not None:
            return Path(spec.file)
        if id(spec) not in self._sources:
            folder = tempfile.TemporaryDirectory(prefix="ferry-grader-")
            self._folders.append(folder)  # removed with this object
            path = Path(folder.name) / "grader.py"
            path.write_text(spec.source)
            self._sources[id(spec)] = path
        return self._sources[id(spec)]

    def _judge(self, spec: Any) -> Any:
        if id(spec) not in self._judges:
            from jobs.objectives.graders.score_model import Judge

            self._judges[id(spec)] = Judge(spec)
        return self._judges[id(spec)]

    def _finite(self, spec: Any, value: Any) -> float:
        """``value`` as a finite float, else 0 with the reason logged once per distinct reason."""
        if isinstance(value, BaseException):
            reason = f"{type(value).__name__}: {value}"
        elif isinstance(value, bool) or not isinstance(value, int | float):
            reason = f"returned {type(value).__name__}, not a number"
        elif not math.isfinite(value):
            reason = f"returned {value}"
        else:
            return float(value)
        message = f"grader {spec.name!r} ({spec.type}): {reason}; reward 0"
        if message not in self._logged:
            self._logged.add(message)
            self._new.append(message)
            log.warning(message)
        return 0.0

    @property
    def errors(self) -> list[str]:
        """The distinct errors logged so far."""
        return sorted(self._logged)

    def take_new_errors(self) -> list[str]:
        """The distinct errors first seen since the last call (for the job's events)."""
        new, self._new = self._new, []
        return new
