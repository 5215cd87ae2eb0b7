"""The text graders: ``string_check`` (OpenAI's four operations) and ``text_similarity`` over rendered templates
(the metrics themselves: jobs/objectives/graders/similarity.py)."""

from __future__ import annotations

from typing import Any

from jobs.objectives.graders.similarity import similarity
from jobs.objectives.graders.templates import render


def string_check(spec: Any, completion: str, row: dict[str, Any]) -> float:
    """1.0 when the rendered input and reference pass ``spec.operation``, else 0.0."""
    given, reference = render(spec.input, completion, row), render(spec.reference, completion, row)
    if spec.operation == "eq":
        return float(given == reference)
    if spec.operation == "ne":
        return float(given != reference)
    if spec.operation == "like":
        return float(reference in given)
    return float(reference.lower() in given.lower())  # ilike


def text_similarity(spec: Any, completion: str, row: dict[str, Any]) -> float:
    """Similarity of the rendered input to the reference, 0 to 1, by ``spec.evaluation_metric`` (every metric but
    cosine, which ``Graders`` computes for a whole batch with its encoder)."""
    given, reference = render(spec.input, completion, row), render(spec.reference, completion, row)
    return similarity(spec.evaluation_metric, given, reference)
