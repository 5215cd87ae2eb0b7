"""Graders: rewards for sampled completions, named and shaped as OpenAI's reinforcement fine-tuning's.

``string_check`` (eq, ne, like, ilike), ``text_similarity`` (fuzzy_match; bleu where sacrebleu is installed),
``python`` (``grade(sample, item) -> float`` from a file, in a subprocess) and ``multi`` (a weighted sum).
Templates read ``{{sample.output_text}}`` (the completion) and ``{{item.<column>}}`` (the prompt row's columns).

A grader that raises, times out or returns something that is not a finite number gives reward 0 for that
completion, and each distinct error is logged once: a bad grader never crashes the job.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_TEMPLATE = re.compile(r"\{\{\s*(sample|item)\.([A-Za-z0-9_]+)\s*\}\}")


def render(template: str, completion: str, row: dict[str, Any]) -> str:
    """``template`` with ``{{sample.output_text}}`` and ``{{item.<column>}}`` filled in; a missing column raises."""

    def fill(match: re.Match[str]) -> str:
        scope, name = match.groups()
        if scope == "sample":
            if name != "output_text":
                raise KeyError(f"sample.{name}: graders read sample.output_text")
            return completion
        if name not in row:
            raise KeyError(f"item.{name}: the row has no column {name!r} (it has {sorted(row)})")
        return str(row[name])

    return _TEMPLATE.sub(fill, template)


class Graders:
    """Rewards of completions under one grader spec (jobs/spec/llm.py's ``Grader``).

    Example:
        >>> grade = Graders(StringCheckGrader(type="string_check", reference="{{item.answer}}"))
        >>> grade(["4", "5"], [{"answer": "4"}, {"answer": "4"}])
        [1.0, 0.0]
    """

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self._logged: set[str] = set()

    def __call__(self, completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        """One finite reward per completion (0 where its grader failed)."""
        return self._grade(self.spec, completions, rows)

    def _grade(self, spec: Any, completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        if spec.type == "multi":
            weights = spec.weights
            total = [0.0] * len(completions)
            for grader in spec.graders:
                weight = weights.get(grader.name, 1.0)
                for index, reward in enumerate(self._grade(grader, completions, rows)):
                    total[index] += weight * reward
            return total
        if spec.type == "python":
            return [self._finite(spec, value) for value in run_python_grader(spec, completions, rows)]
        one = _ONE[spec.type]
        rewards = []
        for completion, row in zip(completions, rows, strict=True):
            try:
                value: Any = one(spec, completion, row)
            except Exception as error:
                value = error
            rewards.append(self._finite(spec, value))
        return rewards

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
            log.warning(message)
        return 0.0

    @property
    def errors(self) -> list[str]:
        """The distinct errors logged so far."""
        return sorted(self._logged)


def string_check(spec: Any, completion: str, row: dict[str, Any]) -> float:
    """1.0 when the rendered input and reference pass ``spec.operation``, else 0.0 (OpenAI's operations)."""
    given, reference = render(spec.input, completion, row), render(spec.reference, completion, row)
    if spec.operation == "eq":
        return float(given == reference)
    if spec.operation == "ne":
        return float(given != reference)
    if spec.operation == "like":
        return float(reference in given)
    return float(reference.lower() in given.lower())  # ilike


def text_similarity(spec: Any, completion: str, row: dict[str, Any]) -> float:
    """Similarity of the rendered input to the reference, 0 to 1."""
    given, reference = render(spec.input, completion, row), render(spec.reference, completion, row)
    if spec.evaluation_metric == "fuzzy_match":
        return difflib.SequenceMatcher(None, given, reference).ratio()
    try:
        import sacrebleu  # type: ignore[import-not-found]
    except ImportError as error:
        raise ValueError("text_similarity bleu needs sacrebleu (pip install sacrebleu); or use fuzzy_match") from error
    return float(sacrebleu.sentence_bleu(given, [reference]).score) / 100


_ONE: dict[str, Callable[[Any, str, dict[str, Any]], float]] = {
    "string_check": string_check,
    "text_similarity": text_similarity,
}

# Runs in the grader's subprocess: its address space capped, each call under a timer.
_WORKER = r"""
import json, math, resource, signal, sys, runpy
job = json.loads(sys.stdin.read())
limit = job["memory_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
results = []
try:
    grade = runpy.run_path(job["file"])["grade"]
except BaseException as error:
    print(json.dumps([f"loading {job['file']}: {type(error).__name__}: {error}"] * len(job["items"])))
    sys.exit(0)
class Late(Exception):
    pass
def late(signum, frame):
    raise Late(f"took longer than {job['timeout_s']} s")
signal.signal(signal.SIGALRM, late)
for sample, item in job["items"]:
    signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
    try:
        value = grade(sample, item)
        signal.setitimer(signal.ITIMER_REAL, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            results.append(f"returned {type(value).__name__}, not a number")
        elif not math.isfinite(value):
            results.append(f"returned {value}")
        else:
            results.append(float(value))
    except BaseException as error:
        signal.setitimer(signal.ITIMER_REAL, 0)
        results.append(f"{type(error).__name__}: {error}")
print(json.dumps(results))
"""


def run_python_grader(spec: Any, completions: list[str], rows: list[dict[str, Any]]) -> list[float | BaseException]:
    """``grade(sample, item)`` of ``spec.file`` for each completion, in one subprocess whose working directory is
    the file's folder, with ``spec.memory_mb`` of address space and ``spec.timeout_s`` per completion.

    Returns a float per completion, or the error that stood in for it."""
    path = Path(spec.file).resolve()
    items = [[{"output_text": c}, row] for c, row in zip(completions, rows, strict=True)]
    job = {"file": str(path), "memory_mb": spec.memory_mb, "timeout_s": spec.timeout_s, "items": items}
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _WORKER],
            input=json.dumps(job, default=str),
            capture_output=True,
            text=True,
            cwd=path.parent,
            timeout=spec.timeout_s * len(items) + 30,  # each call has its timer; this catches a stuck process
            env={"PATH": "/usr/bin:/bin"},
        )
        results = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None
    except subprocess.TimeoutExpired:
        return [TimeoutError(f"took longer than {spec.timeout_s} s")] * len(items)
    except json.JSONDecodeError:
        results = None
    if not isinstance(results, list) or len(results) != len(items):
        stderr = done.stderr.strip().splitlines()[-1:] if done.stderr else []
        reason = stderr[0] if stderr else f"exited with {done.returncode}"
        return [RuntimeError(f"the grader process failed: {reason}")] * len(items)
    return [value if isinstance(value, float) else RuntimeError(value) for value in results]
